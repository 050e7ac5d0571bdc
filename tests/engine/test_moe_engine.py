"""The MoE families in the engine (float32, CPU kernels): greedy tokens equal HF's by the tie rule,
and a request's tokens and logprobs are bit-identical alone, in a batch, with its prompt chunked,
after swap and recompute preemption, from the prefix cache; beam search unchanged by preemption;
both pools empty at the end. (layers/moe.py: every product on the batch-invariant kernel, each
token's experts summed in a fixed order.)"""

from __future__ import annotations

import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.kernels import cpu_fp32
from test_llm_engine import prompts_of_lengths
from utils import assert_tie_rule, hf_greedy, output_key, ours_as_pairs

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "ernie4_5_moe",
            "lfm2_moe", "phimoe", "llama4", "minimax_m2", "dots1", "glm4_moe_lite",
            "hunyuan_v1_moe", "gemma4_moe"]
FAMILIES += ["afmoe", "exaone_moe", "solar_open", "cohere2_moe", "dbrx"]
FAMILIES += ["granitemoe_swa", "laguna", "hy_v3", "mimo_v2_flash"]
PROMPTS = prompts_of_lengths([6, 11, 3, 14, 9], seed=3)
MAX_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def fp32_kernels():
    if not cpu_fp32.fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable (disabled, no AVX2/AVX-512, or build failed)")


def _params(i: int) -> SamplingParams:
    """Greedy for even requests, seeded sampling for odd ones; top-5 logprobs (no prompt
    logprobs: those requests never take cached prefixes)."""
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True,
                              logprobs=5)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _generate(llm: LLM, indices: list[int]) -> dict[int, tuple]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices],
                        [_params(i) for i in indices], use_tqdm=False)
    return {i: output_key(o) for i, o in zip(indices, outs)}


def _llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    kw.setdefault("enable_prefix_caching", False)
    return LLM(path, dtype="float32", block_size=4, **kw)


def _assert_equal(got, ref, what):
    assert got.keys() <= ref.keys()
    for i, key in got.items():
        assert key == ref[i], f"{what}: request {i} (prompt of {len(PROMPTS[i])} tokens) differs: {key} vs {ref[i]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_matches_hf_and_is_exact_under_batching_chunking_preemption_and_caching(
        family, checkpoints, hf_models):
    path = str(checkpoints(family))
    llm = _llm(path, enable_chunked_prefill=False, enable_prefix_caching=True)
    everyone = list(range(len(PROMPTS)))
    ref = _generate(llm, everyone)  # all at once, a roomy cache
    # greedy requests (the even ones) against HF transformers
    for i in everyone[:4:2]:
        tokens, _, _, logprobs = ref[i][0][0]  # output_key: the completion
        want = hf_greedy(hf_models(family), PROMPTS[i], MAX_TOKENS)
        assert_tie_rule((list(tokens), [dict((t, lp) for t, lp, _ in pos) for pos in logprobs]), want,
                        f"{family} request {i}")
    _assert_equal(_generate(llm, [3]), ref, "alone, prefix cache hits")
    _assert_equal(_generate(llm, everyone[::-1]), ref, "reversed, prefix cache hits")
    assert llm.engine.kv_manager.prefix_hits > 0
    # a tiny cache: prompts chunked at 5 tokens, preempted by swap into a tiny CPU pool and by
    # recomputation when that is full
    # (LFM2-MoE's conv window is a second KV group over the pool: a sequence takes more blocks)
    # (Gemma 4's sliding and full layers likewise)
    blocks = {"lfm2_moe": 10, "gemma4_moe": 16, "afmoe": 12, "exaone_moe": 12, "cohere2_moe": 12,
              "granitemoe_swa": 12, "laguna": 12, "mimo_v2_flash": 12}.get(family, 7)
    small = _llm(path, kv_cache_memory=None, num_kv_blocks=blocks,
                 num_cpu_blocks=6 if family == "gemma4_moe" else 2, preemption_mode="swap",
                 max_num_batched_tokens=5)
    _assert_equal(_generate(small, everyone), ref, "chunked and preempted")
    modes = small.engine.scheduler.preemptions_by_mode
    assert modes["swap"] > 0 and modes["recompute"] > 0, modes
    kv = small.engine.kv_manager
    assert kv.pool.num_used == 0 and kv.cpu_pool.num_used == 0


@pytest.mark.parametrize("family", ["qwen2_moe"])
def test_moe_beam_search_is_unchanged_by_preemption(family, checkpoints):
    path = str(checkpoints(family))
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    ref = _llm(path).beam_search(prompts, params)
    small = _llm(path, kv_cache_memory=None, num_kv_blocks=16, preemption_mode="recompute")
    got = small.beam_search(prompts, params)
    assert [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in ref]
    assert small.engine.num_used_blocks() == 0
