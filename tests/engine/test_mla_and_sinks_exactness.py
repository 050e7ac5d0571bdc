"""The same-engine exactness guarantees on DeepSeek V2 (latent attention: the latent cache is
what preemption, swapping, prefix caching and copy-on-write move around) and gpt-oss (attention
sinks, sliding windows): float32 tokens and logprobs -- and beams -- under a tight cache with
recompute or swap preemption, chunked prefill at a small budget and prefix-cache hits are
exactly those of a roomy run."""

from __future__ import annotations

import importlib.util

import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.kernels import cpu_fp32
from test_llm_engine import prompts_of_lengths
from utils import output_key

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not cpu_fp32.fp32_kernels_available(), reason="fp32 invariant kernels unavailable"),
    # NOTE: both families have MoE layers (layers/moe.py, merged separately)
    pytest.mark.skipif(importlib.util.find_spec("pagedserve.layers.moe") is None,
                       reason="layers/moe.py not merged yet"),
]

PROMPTS = prompts_of_lengths([13, 6, 15], seed=5)
SHARED = PROMPTS[0][:8]  # a shared prefix of two blocks (block_size 4)
PROMPTS += [SHARED + [7, 8, 9], SHARED + [11, 12, 13, 14, 15]]


def _params(i: int) -> SamplingParams:
    """Greedy for even requests, seeded sampling for odd ones; logprobs and prompt logprobs."""
    return SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=8, ignore_eos=True,
                          logprobs=3, prompt_logprobs=2)


def _run(llm: LLM) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    return [output_key(o) for o in outs]


BEAMS = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.0)


def _beams(llm: LLM) -> list:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[1:3]], BEAMS)
    return [output_key(o) for o in outs]


@pytest.mark.parametrize("arch,mode,dtype", [("deepseek_v2", "recompute", "float32"),
                                              ("gpt_oss", "swap", "float32"),
                                              ("gpt_oss", "recompute", "bfloat16")])
def test_tight_cache_chunked_prefill_and_prefix_hits_equal_a_roomy_run(checkpoints, arch, mode, dtype):
    """(gpt-oss in bf16: its sinks' attention is the bf16 decode kernel for every token, prompt
    or decode, so recompute and chunking keep every bit there too.)"""
    path = str(checkpoints(arch))
    roomy = LLM(path, dtype=dtype, block_size=4, kv_cache_memory=1 << 22,
                enable_chunked_prefill=False, enable_prefix_caching=False)
    ref, ref_beams = _run(roomy), _beams(roomy)
    llm = LLM(path, dtype=dtype, block_size=4, num_kv_blocks=12, num_cpu_blocks=64,
              preemption_mode=mode, enable_chunked_prefill=True, max_num_batched_tokens=5,
              enable_prefix_caching=True)
    assert _run(llm) == ref, mode
    assert llm.engine.scheduler.preemptions_by_mode[mode] > 0, mode
    assert _run(llm) == ref, f"{mode}: prefix-cache hits"  # the second run hits the cache
    assert _beams(llm) == ref_beams, mode
    assert llm.engine.num_used_blocks() == 0
