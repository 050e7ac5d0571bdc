"""Pipeline parallelism on a model of several KV groups (Gemma 3: sliding-window and full
layers): every stage lays out the whole model's groups (the scheduler's block tables and
per-group accounting unchanged) and allocates only its own layers' slots; PP=2 gives PP=1's
tokens and logprobs exactly in float32, under swap and recompute preemption and prefix hits.

The stages run in this process (`PipelineExecutor.in_process`: the same stage code, micro-batches
and block operations as the Ray actors of tests/distributed/test_ray_scale.py, without Ray's
start-up)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.models.base import KVCacheSpec
from pagedserve.worker import pp_executor
from pagedserve.worker.kv_cache import KVCache, bytes_per_block, held_slots, kv_layout
from utils import output_key

_rng = random.Random(11)
PROMPTS = [[1] + [_rng.randrange(3, 500) for _ in range(n - 1)]
           for n in (23, 9, 30, 17)]  # several windows (6) long
PROMPTS.append(PROMPTS[2][:16] + [5, 6, 7])  # a prefix hit of 4 blocks


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=10,
                          ignore_eos=True, logprobs=2, prompt_logprobs=2)


def _run(llm: LLM) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    return [output_key(o) for o in outs]


def test_a_stage_allocates_only_its_layers_slots_of_the_whole_layout():
    full = FullAttentionSpec(2, 8)
    spec = KVCacheSpec(4, 2, 8)  # one group: every layer a slot of one lane
    stages = KVCacheSpec(4, 2, 8, stages=((0, 3), (3, 4)))
    assert held_slots(stages, kv_layout(stages)) == [(0, 1, 2), (3,)]
    f32 = torch.float32
    assert bytes_per_block(stages, 4, f32) == bytes_per_block(spec, 4, f32) * 3 // 4
    second = KVCache(KVCacheSpec(4, 2, 8, stages=((3, 4),)), 5, 4, f32, torch.device("cpu"),
                     num_cpu_blocks=2)
    assert [k is not None for k, _ in second.layers] == [False, False, False, True]
    assert [k is not None for k, _ in second.cpu_layers] == [False, False, False, True]
    second.swap_out([(1, 0)])
    second.copy_blocks([(1, 2)])
    # several groups: the whole model's columns on every stage
    hybrid = KVCacheSpec(4, 2, 8, layers=(SlidingWindowSpec(2, 8, window=6),) * 3 + (full,),
                         stages=((0, 2), (2, 4)))
    assert kv_layout(hybrid).width == 4 and held_slots(hybrid, kv_layout(hybrid)) == [(0,), (0,)]
    with pytest.raises(ValueError, match="stages"):
        bytes_per_block(KVCacheSpec(4, 2, 8, stages=((2, 5),)), 4, f32)


@pytest.mark.timeout(120)
def test_two_stages_of_a_sliding_and_full_model_give_one_stages_outputs(checkpoints, monkeypatch):
    stages = pp_executor.PipelineExecutor
    monkeypatch.setattr(pp_executor, "PipelineExecutor",
                        lambda config, n, address=None: stages.in_process(config, n))
    path = str(checkpoints("gemma3"))  # 3 sliding (window 6) layers and a full one
    # a tight cache: requests are preempted; prefix caching and chunked prefill on
    options = dict(dtype="float32", block_size=4, num_kv_blocks=40, num_cpu_blocks=80,
                   max_num_seqs=8, enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=16)
    one = LLM(path, preemption_mode="swap", **options)
    two = LLM(path, pipeline_parallel_size=2, preemption_mode="swap", **options)
    executor = two.engine.executor
    assert executor.num_stages == 2 and two.engine.kv_layout.width == 4  # 3 sliding + 1 full
    assert two.engine.kv_layout == one.engine.kv_layout
    for mode in ("swap", "recompute"):
        for llm in (one, two):
            llm.engine.reconfigure_cache(preemption_mode=mode)
        refs = _run(one)
        assert _run(two) == refs, mode
        assert two.engine.scheduler.preemptions_by_mode.get(mode, 0) > 0, mode
        assert _run(two) == refs, f"{mode}: prefix-cache hits"
    assert two.engine.num_used_blocks() == 0
    assert executor.micro_batches > two.engine.stats["steps"]  # steps cut into micro-batches
    two.engine.shutdown()
