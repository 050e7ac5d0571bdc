"""Preemption modes and chunked prefill leave outputs unchanged (float32, tie rule), FCFS holds for
swapped requests, and both pools end empty."""

import pytest

from pagedserve import LLM, SamplingParams
from test_llm_engine import greedy, prompts_of_lengths, run
from utils import assert_tie_rule, ours_as_pairs

PROMPTS = prompts_of_lengths([6, 11, 3, 14, 9, 5, 12, 8, 17, 4], seed=3)


@pytest.fixture(scope="module")
def reference(checkpoints):
    path = str(checkpoints("gemma3"))
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22,
              enable_chunked_prefill=False)
    return path, run(llm, PROMPTS, greedy(24))


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_every_preemption_mode_with_a_tiny_cpu_pool_gives_unconstrained_outputs(mode, reference):
    path, ref = reference
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=16, num_cpu_blocks=10,
              preemption_mode=mode, max_num_batched_tokens=32)
    outs = run(llm, PROMPTS, greedy(24))
    for a, b in zip(outs, ref):
        assert_tie_rule(ours_as_pairs(a), ours_as_pairs(b), mode)
    sched = llm.engine.scheduler
    if mode == "recompute":
        assert sched.preemptions_by_mode == {"recompute": sched.num_preemptions, "swap": 0}
    else:
        # The CPU pool is too small for all of it: both swapping and recomputation happened.
        assert sched.preemptions_by_mode["swap"] > 0
        assert sched.preemptions_by_mode["recompute"] > 0
    kv = llm.engine.kv_manager
    assert kv.pool.num_used == 0 and (kv.cpu_pool is None or kv.cpu_pool.num_used == 0)
    kv.check_invariants()


def test_chunked_prefill_on_and_off_give_the_same_outputs(reference):
    path, ref = reference
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22,
              enable_chunked_prefill=True, max_num_batched_tokens=5)
    outs = run(llm, PROMPTS, greedy(24))
    for a, b in zip(outs, ref):
        assert_tie_rule(ours_as_pairs(a), ours_as_pairs(b))


def test_seeded_sampling_is_the_same_with_chunked_prefill(reference):
    path, _ = reference
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    a = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22,
            enable_chunked_prefill=False).generate(prompts, params, use_tqdm=False)
    b = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22,
            max_num_batched_tokens=3).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_decode_tokens_are_scheduled_before_a_long_prompt_chunk(reference):
    path, _ = reference
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22,
              max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("short", None, greedy(30), prompt_token_ids=PROMPTS[2])
    engine.step()
    engine.add_request("long", None, greedy(2), prompt_token_ids=prompts_of_lengths([60])[0])
    for _ in range(5):  # the long prompt takes 8 steps of 8 tokens; "short" gains one each step
        before = engine.groups["short"].seqs[0].num_output_tokens
        engine.step()
        assert engine.groups["short"].seqs[0].num_output_tokens == before + 1
    while engine.has_unfinished_requests():
        engine.step()


def test_swapped_groups_come_back_before_newer_requests_are_admitted(reference):
    path, _ = reference
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=12, num_cpu_blocks=64,
              preemption_mode="swap", max_num_batched_tokens=64)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", None, greedy(20), prompt_token_ids=p)
    late_added = late_running = False
    swapped_when_late_admitted = None
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        if sched.swapped and not late_added:
            engine.add_request("late", None, greedy(4), prompt_token_ids=PROMPTS[5])
            late_added = True
        engine.step()
        if late_added and not late_running and any(g.request_id == "late" for g in sched.running):
            late_running = True
            swapped_when_late_admitted = [g.request_id for g in sched.swapped]
    assert late_added and late_running
    assert sched.preemptions_by_mode["swap"] > 0
    # "late" is admitted only in a step that brought every swapped group back first.
    assert swapped_when_late_admitted == []
    assert engine.kv_manager.pool.num_used == 0 and engine.kv_manager.cpu_pool.num_used == 0
