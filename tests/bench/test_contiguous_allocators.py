"""Every KV allocator (paged and the Orca-style contiguous baselines, plugged in through the
engine's `kv_manager_factory`) serves the same requests with the same greedy outputs on the same
budget; paging batches at least as many at once."""

import random

import pytest
from utils import ours_as_pairs

from pagedserve import EngineArgs, LLMEngine, SamplingParams
from pagedserve.bench.contiguous import KV_ALLOCATORS, kv_manager_factory

ALLOCATORS = list(KV_ALLOCATORS)


def prompts_of_lengths(lengths, seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in lengths]


def engine(path, allocator, **options):
    # NOTE: one group of full attention, as the paper's comparison has it: the tiny Gemma 3's
    # sliding-window group would otherwise hand back blocks the contiguous baselines cannot.
    args = EngineArgs(path, dtype="float32", block_size=4, max_model_len=64,
                      disable_hybrid_kv_cache_manager=True, **options)
    return LLMEngine(args, kv_manager_factory=kv_manager_factory(allocator))


PROMPTS = prompts_of_lengths([6, 11, 3, 14, 9, 5, 12, 8, 17, 4, 7, 10], seed=5)
MAX_TOKENS = [5, 20, 9, 3, 16, 12, 7, 18, 4, 11, 14, 6]


def _serve(path, allocator):
    """Run every prompt through one engine step by step; (outputs, max batch, engine)."""
    eng = engine(path, allocator, num_kv_blocks=24, max_num_batched_tokens=64)
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        eng.add_request(str(i), None, SamplingParams(temperature=0.0, max_tokens=n,
                                                     ignore_eos=True, logprobs=5),
                        prompt_token_ids=p)
    outs, max_batch = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
        max_batch = max(max_batch, len(eng.scheduler.running))
        eng.check_invariants()
    return [outs[str(i)] for i in range(len(PROMPTS))], max_batch, eng


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
        assert ours_as_pairs(out) == ours_as_pairs(r), allocator
    assert engine.num_used_blocks() == 0
    if allocator != "paged":  # a running reservation never needs memory: no preemption
        assert engine.scheduler.num_preemptions == 0
        assert not engine.kv_manager.reservations and not engine.kv_manager._lengths


def test_paged_batches_at_least_as_many_requests_as_each_contiguous_mode(runs):
    paged = runs["paged"][1]
    for allocator in ALLOCATORS[1:]:
        assert paged >= runs[allocator][1], allocator
    assert paged > runs["contiguous-max"][1]


def test_contiguous_allocators_refuse_sharing_and_oversized_reservations(checkpoints):
    path = str(checkpoints("gemma3"))
    eng = engine(path, "contiguous-oracle", num_kv_blocks=12)
    assert eng.num_cpu_blocks == 0  # no swap pool on the workers either
    with pytest.raises(ValueError, match="does not share"):
        eng.add_request("a", None, SamplingParams(n=2, max_tokens=4), prompt_token_ids=[5])
    with pytest.raises(ValueError, match="reserves"):
        eng.add_request("b", None, SamplingParams(max_tokens=60), prompt_token_ids=[5] * 3)
    assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="reserves"):  # 64 tokens = 16 blocks > 12
        engine(path, "contiguous-max", num_kv_blocks=12)


def test_reconfigure_cache_switches_the_kv_manager_and_back_to_paging(checkpoints):
    eng = engine(str(checkpoints("gemma3")), "paged", num_kv_blocks=24)
    eng.reconfigure_cache(kv_manager_factory("contiguous-pow2"), enable_prefix_caching=False)
    assert eng.kv_manager.policy == "pow2"
    eng.reconfigure_cache()
    assert type(eng.kv_manager).__name__ == "KVCacheManager" and eng.num_cpu_blocks > 0
