"""Every KV allocator (paged and the Orca-style contiguous baselines) serves the same requests
with the same greedy outputs on the same budget; paging batches at least as many at once."""

import pytest
from test_llm_engine import prompts_of_lengths
from utils import assert_tie_rule, ours_as_pairs

from pagedserve import LLM, SamplingParams

ALLOCATORS = ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]
PROMPTS = prompts_of_lengths([6, 11, 3, 14, 9, 5, 12, 8, 17, 4, 7, 10], seed=5)
MAX_TOKENS = [5, 20, 9, 3, 16, 12, 7, 18, 4, 11, 14, 6]


def _serve(path, allocator):
    """Run every prompt through one engine step by step; (outputs, max batch, engine)."""
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=64,
              max_num_batched_tokens=64, kv_allocator=allocator)
    engine = llm.engine
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(str(i), None, SamplingParams(temperature=0.0, max_tokens=n,
                                                        ignore_eos=True, logprobs=5),
                           prompt_token_ids=p)
    outs, max_batch = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
        max_batch = max(max_batch, len(engine.scheduler.running))
        engine.check_invariants()
    return [outs[str(i)] for i in range(len(PROMPTS))], max_batch, engine


@pytest.fixture(scope="module")
def runs(checkpoints):
    path = str(checkpoints("gemma3"))
    return {a: _serve(path, a) for a in ALLOCATORS}


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_every_allocator_completes_every_request_with_the_same_greedy_outputs(allocator, runs):
    outs, _, engine = runs[allocator]
    ref, _, _ = runs["paged"]
    for out, n, r in zip(outs, MAX_TOKENS, ref):
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert_tie_rule(ours_as_pairs(out), ours_as_pairs(r), allocator)
    assert engine.num_used_blocks() == 0
    if allocator != "paged":  # a running reservation never needs memory: no preemption
        assert engine.scheduler.num_preemptions == 0
        assert not engine.kv_manager.reservations and not engine.kv_manager._final_len


def test_paged_batches_at_least_as_many_requests_as_each_contiguous_mode(runs):
    paged = runs["paged"][1]
    for allocator in ALLOCATORS[1:]:
        assert paged >= runs[allocator][1], allocator
    assert paged > runs["contiguous-max"][1]


def test_contiguous_allocators_refuse_sharing_and_oversized_reservations(checkpoints):
    path = str(checkpoints("gemma3"))
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=12, max_model_len=64,
              kv_allocator="contiguous-oracle")
    with pytest.raises(ValueError, match="kv_allocator"):
        llm.engine.add_request("a", None, SamplingParams(n=2, max_tokens=4), prompt_token_ids=[5])
    with pytest.raises(ValueError, match="reserves"):
        llm.engine.add_request("b", None, SamplingParams(max_tokens=60), prompt_token_ids=[5] * 3)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="reserves"):  # 64 tokens = 16 blocks > 12
        LLM(path, dtype="float32", block_size=4, num_kv_blocks=12, max_model_len=64,
            kv_allocator="contiguous-max")
    with pytest.raises(ValueError, match="kv_allocator"):
        LLM(path, kv_allocator="buddy")
