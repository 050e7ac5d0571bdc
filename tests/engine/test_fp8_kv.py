"""fp8 KV blocks in the engine (kv_cache_dtype fp8 = fp8_e4m3, fp8_e5m2): twice the blocks of a
bf16 cache in one budget; a float32 model's tokens and logprobs exactly those of a roomy fp8 run
through chunked prefill, swap and recompute preemption, prefix caching, copy-on-write and other
batches (Gemma 3's sliding and full layer groups); greedy tokens within vLLM's tie rule of the
bf16-KV run."""

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.worker.kv_cache import KVCache, max_concurrency, num_blocks_for_budget
from test_llm_engine import greedy, prompts_of_lengths, run
from utils import assert_same_outputs, assert_tie_rule, ours_as_pairs, run_requests

_PREFIX = prompts_of_lengths([12], seed=31)[0]
PROMPTS = [_PREFIX + p[1:] for p in prompts_of_lengths([5, 3], seed=32)] + \
    prompts_of_lengths([14, 7], seed=33)
# every prompt greedy, and one seeded n=2 request: its two sequences share the prompt's blocks
# (a partial last one) until they diverge (copy-on-write)
REQUESTS = [(f"g{i}", p, greedy(8)) for i, p in enumerate(PROMPTS)] + [
    ("n2", PROMPTS[3], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8,
                                      ignore_eos=True, logprobs=2))]
BUDGET = 1 << 21


@pytest.fixture(scope="module")
def roomy(checkpoints):
    path = str(checkpoints("gemma3"))
    # NOTE: a small CPU swap pool in every engine here: the default 4 GiB of a tiny model's fp8
    # blocks (16M of them) takes seconds to allocate and list
    outs, engine = run_requests(path, REQUESTS, 500, block_size=4, kv_cache_memory=BUDGET,
                                kv_cache_dtype="fp8", enable_prefix_caching=False,
                                enable_chunked_prefill=False, num_cpu_blocks=16)
    return path, outs, engine


def test_fp8_blocks_take_half_the_bytes_of_bf16_ones(roomy):
    # The startup figures: twice the blocks (and the concurrency) of a bf16 cache in one budget.
    _, _, engine = roomy
    assert engine.kv_cache.slots[0][0].dtype is torch.float8_e4m3fn
    spec, layout = engine.executor.kv_cache_spec, engine.kv_layout
    bf16 = num_blocks_for_budget(spec, 4, torch.bfloat16, BUDGET)
    assert engine.num_kv_blocks + 1 == 2 * (bf16 + 1)  # (each count leaves out the null block)
    chunk = engine.max_model_len  # (chunked prefill off)
    assert engine.max_concurrency >= 2 * max_concurrency(bf16, 4, engine.max_model_len, layout,
                                                         chunk)


def test_fp8_outputs_are_exact_through_chunking_preemption_prefix_caching_and_batching(
        roomy, monkeypatch):
    from pagedserve.kernels import cpu_fp32

    if not cpu_fp32.fp32_kernels_available():  # (README: torch's float32 is not batch-invariant)
        pytest.skip("float32 batch-invariant kernels unavailable")
    path, ref, _ = roomy
    copies = []  # copy-on-write pairs the worker's fp8 cache copied
    real = KVCache.copy_blocks
    monkeypatch.setattr(KVCache, "copy_blocks",
                        lambda self, pairs: (copies.extend(pairs), real(self, pairs))[1])
    # a pool of a few blocks: requests preempted by swap (a small CPU pool) and by recompute,
    # prompts in chunks of 8 tokens, the shared prefix served from the prefix cache
    outs, engine = run_requests(path, REQUESTS, 3000, block_size=4, num_kv_blocks=28,
                                num_cpu_blocks=8, preemption_mode="auto",
                                max_num_batched_tokens=8, kv_cache_dtype="fp8")
    sched, kv = engine.scheduler, engine.kv_manager
    assert sched.preemptions_by_mode["swap"] > 0 and sched.preemptions_by_mode["recompute"] > 0
    assert kv.prefix_hits > 0 and copies
    assert kv.cpu_pool.num_used == 0  # (and the GPU-side pool: run_requests checks it)
    assert_same_outputs(outs, ref)


def test_fp8_greedy_tokens_are_within_the_tie_rule_of_the_bf16_cache(checkpoints):
    # bf16 model: the bf16 decode kernel (the fused decode layer where it applies) and the prefill
    # path widen fp8 here.
    path = str(checkpoints("gemma3"))
    prompts = PROMPTS[2:]
    outs = {dt: run(LLM(path, dtype="bfloat16", kv_cache_dtype=dt, block_size=4,
                        kv_cache_memory=BUDGET, num_cpu_blocks=16), prompts, greedy(8))
            for dt in ("auto", "fp8", "fp8_e5m2")}
    for dt in ("fp8", "fp8_e5m2"):
        for ours, ref in zip(outs[dt], outs["auto"]):
            assert_tie_rule(ours_as_pairs(ours), ours_as_pairs(ref), dt)


@pytest.mark.parametrize("bad", ["fp8_inc", "float8", "FP8", ""])
def test_other_kv_cache_dtypes_are_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("unused-model-name", kv_cache_dtype=bad)


def test_fp8_blocks_are_refused_where_no_kernel_reads_them(checkpoints):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*torch attention backend"):
        LLM(str(checkpoints("gemma3")), kv_cache_dtype="fp8", attention_backend="triton")
