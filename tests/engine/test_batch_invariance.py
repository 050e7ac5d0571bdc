"""Float32 on CPU with the compiled kernels is batch-invariant: a request's tokens and logprobs
(sampled and prompt) are bit-identical whether it runs alone, among others, with its prompt
chunked at small budgets, after recompute or swap preemption, or from the prefix cache
(kernels/cpu_fp32.py: fixed-order linear layers, per-token attention, one-formula activations).
All scenarios on the tiny llama; recompute also on qwen3 (q/k norms) and gemma3 (sliding windows,
GQA 4:1, gelu, query pre-attention scaling)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import cpu_fp32
from test_llm_engine import prompts_of_lengths
from utils import output_key

pytestmark = pytest.mark.timeout(600)

PROMPTS = prompts_of_lengths([6, 11, 3, 14, 9, 5, 12, 8, 17, 4], seed=3)
MAX_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def fp32_kernels():
    if not cpu_fp32.fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable (disabled, no AVX2/AVX-512, or build failed)")


def _params(i: int) -> SamplingParams:
    """Greedy for even requests, seeded sampling for odd ones; top-5 and prompt logprobs."""
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True,
                              logprobs=5, prompt_logprobs=3)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                          prompt_logprobs=3)


def _generate(llm: LLM, indices: list[int]) -> dict[int, tuple]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices],
                        [_params(i) for i in indices], use_tqdm=False)
    return {i: output_key(o) for i, o in zip(indices, outs)}


def _llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, dtype="float32", block_size=4, enable_prefix_caching=False, **kw)


@pytest.fixture(scope="module")
def alone(request, checkpoints):
    """Each request of a tiny model (indirect parameter: its architecture) run alone (no
    chunking: the whole prompt in one step)."""
    path = str(checkpoints(request.param))
    llm = _llm(path, enable_chunked_prefill=False)
    ref = {}
    for i in range(len(PROMPTS)):
        ref.update(_generate(llm, [i]))
    return path, ref


def _assert_equal(got: dict[int, tuple], ref: dict[int, tuple]) -> None:
    for i, key in got.items():
        assert key == ref[i], f"request {i} (prompt of {len(PROMPTS[i])} tokens) differs"


@pytest.mark.parametrize("alone", ["llama"], indirect=True)
def test_request_in_a_batch_is_bitwise_the_same_as_alone(alone):
    path, ref = alone
    _assert_equal(_generate(_llm(path, enable_chunked_prefill=False), list(range(len(PROMPTS)))), ref)


@pytest.mark.parametrize("budget", [3, 5])
@pytest.mark.parametrize("alone", ["llama"], indirect=True)
def test_chunked_prefill_at_small_budgets_is_bitwise_the_same_as_alone(alone, budget):
    path, ref = alone
    llm = _llm(path, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    _assert_equal(_generate(llm, list(range(len(PROMPTS)))), ref)


# Pool blocks of the same bytes as 16 blocks of every layer: the tiny Gemma 3 mixes
# sliding-window and full layers, and one of its pool blocks holds one layer of its four.
BLOCKS_16 = {"llama": 16, "qwen3": 16, "gemma3": 64}


@pytest.mark.parametrize("alone,mode", [("llama", "recompute"), ("llama", "swap"),
                                        ("qwen3", "recompute"), ("gemma3", "recompute")],
                         indirect=["alone"])
def test_preempted_request_is_bitwise_the_same_as_alone(alone, mode, request):
    path, ref = alone
    arch = request.node.callspec.params["alone"]
    llm = _llm(path, kv_cache_memory=None, num_kv_blocks=BLOCKS_16[arch], num_cpu_blocks=256,
               preemption_mode=mode, max_num_batched_tokens=32)
    _assert_equal(_generate(llm, list(range(len(PROMPTS)))), ref)
    assert llm.engine.scheduler.preemptions_by_mode[mode] > 0
    assert llm.engine.num_used_blocks() == 0


@pytest.mark.parametrize("alone", ["llama"], indirect=True)
def test_prefix_cache_hit_is_bitwise_the_same_as_alone(alone):
    path, ref = alone
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22,
              enable_prefix_caching=True)
    _generate(llm, list(range(len(PROMPTS))))  # fills the prefix cache
    again = _generate(llm, list(range(len(PROMPTS))))
    _assert_equal(again, ref)
