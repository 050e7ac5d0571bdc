"""Preemption modes and chunked prefill leave outputs unchanged (float32: exactly), FCFS holds for
swapped requests, and both pools end empty."""

import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from test_llm_engine import greedy, prompts_of_lengths, run
from utils import assert_same_outputs, drive, ours_as_pairs, run_requests

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
    # (the tiny Gemma 3 mixes sliding-window and full layers: a pool block holds one layer of
    # the four, so 64 blocks are the bytes 16 blocks of all four layers were)
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64, num_cpu_blocks=20,
              preemption_mode=mode, max_num_batched_tokens=32)
    outs = run(llm, PROMPTS, greedy(24))
    for a, b in zip(outs, ref):
        assert ours_as_pairs(a) == ours_as_pairs(b), mode
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
        assert ours_as_pairs(a) == ours_as_pairs(b)


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
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=48, num_cpu_blocks=256,
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


# --- regressions of sharing x preemption (exact comparisons with a roomy cache) --------------

def _roomy_and_tight(path, requests, max_steps, **tight):
    """Run the same requests on a roomy cache and on `tight` settings; returns both outputs."""
    return [run_requests(path, requests, max_steps, **options)
            for options in (dict(kv_cache_memory=1 << 24), tight)]


def test_multi_sequence_group_preempted_by_recomputation_finishes_with_the_same_samples(checkpoints):
    # Regression: after recomputation every sequence recomputes its output (4 x 33 tokens here),
    # more than a step's budget; the group never ran again and step() spun forever.
    prompt = prompts_of_lengths([6], seed=5)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True,
                            logprobs=2)
    requests = [("a", prompt, params), ("b", prompt, params.clone())]
    (ref, _), (outs, engine) = _roomy_and_tight(
        str(checkpoints("llama")), requests, 3000, num_kv_blocks=16,
        max_num_batched_tokens=32, preemption_mode="recompute", enable_prefix_caching=False)
    assert engine.scheduler.preemptions_by_mode["recompute"] > 0
    assert_same_outputs(outs, ref)


@pytest.mark.parametrize("kind", ["beam", "n"])
def test_swap_preemption_of_sharing_groups_keeps_outputs_exact(kind, checkpoints):
    # Regression: a victim already scheduled in the step lost its pending copy-on-write copies
    # and its never-written copy target was swapped out (beam scores changed).
    prompts = prompts_of_lengths([7, 10, 5, 9], seed=11)
    if kind == "beam":
        params = BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True)
    else:
        params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=14, ignore_eos=True,
                                logprobs=1)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    (ref, _), (outs, engine) = _roomy_and_tight(
        str(checkpoints("llama")), requests, 2000, block_size=4, num_kv_blocks=14,
        num_cpu_blocks=64, preemption_mode="swap", max_num_batched_tokens=16,
        enable_prefix_caching=False)
    assert engine.scheduler.preemptions_by_mode["swap"] > 0
    assert_same_outputs(outs, ref)


def test_prompt_logprobs_are_not_duplicated_when_a_chunked_prompt_is_recomputed(checkpoints):
    # Regression: entries were appended chunk by chunk and never reset on recomputation (a
    # 60-token prompt returned 214 entries).
    long, short = prompts_of_lengths([60, 8], seed=7)
    requests = [("old", short, greedy(40)),
                ("plp", long, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2,
                                            ignore_eos=True))]
    (ref, _), (outs, engine) = _roomy_and_tight(
        str(checkpoints("llama")), requests, 2000, block_size=4, num_kv_blocks=17,
        max_num_batched_tokens=8, preemption_mode="recompute")
    assert outs[1].num_preemptions > 0
    assert len(outs[1].prompt_logprobs) == 60
    assert_same_outputs(outs, ref)


@pytest.mark.parametrize("params", [SamplingParams(n=4, temperature=1.0),
                                    SamplingParams(n=2, best_of=3, temperature=1.0),
                                    SamplingParams(n=3, temperature=0.0, use_beam_search=True)])
def test_request_wider_than_max_num_seqs_is_rejected_and_others_are_served(params, checkpoints):
    # Regression: it was accepted, could never start, and blocked every later request (FCFS).
    llm = LLM(str(checkpoints("llama")), dtype="float32", max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.engine.add_request("wide", None, params, prompt_token_ids=[1, 5, 9])
    llm.engine.add_request("ok", None, greedy(3), prompt_token_ids=[1, 5, 9])
    assert list(drive(llm.engine, 50)) == ["ok"]
