"""The scheduler alone (no model, a fake runner): FCFS admission, iteration-level batching,
preemption, and the state update after a step."""

import pytest

from pagedserve.core.beam_search import BeamSearchParams, BeamState
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.step_output import SampleResult, SeqStepOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = iter(range(10**6))


def group(rid, prompt_len, n=1, arrival=0.0, **params):
    params.setdefault("max_tokens", 100)
    params = SamplingParams(n=n, **params)
    g = SequenceGroup(rid, [Sequence(next(_ids), list(range(prompt_len)), i) for i in range(n)],
                      params, arrival)
    g.fork_pending = n > 1  # as the engine queues it: the prompt is prefilled once, then forked
    if params.prompt_logprobs is not None:
        g.prompt_logprobs = [None]
    return g


def fake_results(out, token=7):
    """What a model runner would return: token `token` for every sample a row draws."""
    return [SeqStepOutput(s.seq.seq_id,
                          [SampleResult(token, -1.0, 1, None)] * s.num_samples if s.do_sample else [],
                          [(-1.0, 1, [])] * s.num_tokens if s.wants_prompt_logprobs else None)
            for s in out.scheduled]


def run_step(sched):
    """Schedule one step and pretend the model ran: every sampled sequence gains token 7."""
    out = sched.schedule()
    sched.update_from_output(out, fake_results(out))
    sched.check_invariants()
    return out


def make(num_blocks=8, block_size=4, **cfg):
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("max_num_batched_tokens", 64)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size))


def test_step_mixes_new_prompt_tokens_with_decode_tokens_of_running_requests():
    sched = make()
    sched.add(group("a", 5))
    out = run_step(sched)
    assert [(s.group.request_id, s.num_tokens) for s in out.scheduled] == [("a", 5)]
    sched.add(group("b", 3))
    out = run_step(sched)
    assert [(s.group.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 3)]


def test_admission_is_fcfs_and_waits_for_free_blocks():
    sched = make(num_blocks=4, block_size=4)
    sched.add(group("a", 12))  # 3 blocks
    sched.add(group("b", 8))  # 2 blocks: does not fit next to a
    sched.add(group("c", 1))  # would fit, but FCFS: must not overtake b
    out = run_step(sched)
    assert [s.group.request_id for s in out.scheduled] == ["a"]
    assert [g.request_id for g in sched.waiting] == ["b", "c"]
    sched.finish_seq(sched.running[0].seqs[0], SequenceStatus.FINISHED_LENGTH)
    sched.remove_finished()
    out = run_step(sched)
    assert [s.group.request_id for s in out.scheduled] == ["b", "c"]
    assert out.finished_request_ids == ["a"]


def test_sequence_gains_a_block_only_when_its_last_block_fills():
    sched = make(num_blocks=8, block_size=4)
    sched.add(group("a", 3))
    run_step(sched)  # prefill 3 tokens, sample the 4th
    seq = sched.running[0].seqs[0]
    assert len(sched.kv.block_table(seq.seq_id)) == 1
    run_step(sched)  # writes position 3: still block 0
    assert len(sched.kv.block_table(seq.seq_id)) == 1
    run_step(sched)  # writes position 4: a second block
    assert len(sched.kv.block_table(seq.seq_id)) == 2


def test_out_of_blocks_preempts_the_latest_request_which_is_recomputed_whole_at_the_front():
    sched = make(num_blocks=4, block_size=4)
    sched.add(group("old", 8, arrival=0.0))  # 2 blocks, full
    sched.add(group("new", 8, arrival=1.0))  # 2 blocks, full
    run_step(sched)
    assert sched.kv.num_free_blocks == 0
    sched.add(group("newest", 1, arrival=2.0))
    out = run_step(sched)  # "old" needs a 3rd block: "new" is evicted
    assert [g.request_id for g in out.preempted] == ["new"]
    assert [s.group.request_id for s in out.scheduled] == ["old"]
    assert [g.request_id for g in sched.waiting] == ["new", "newest"]
    new = sched.waiting[0]
    assert new.seqs[0].num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.seqs[0].num_tokens == 9  # keeps its prompt and its sampled token
    # Once "old" is done, "new" comes back first, all 9 tokens in one prefill.
    sched.finish_seq(sched.running[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    sched.remove_finished()
    out = run_step(sched)
    assert [(s.group.request_id, s.start, s.end) for s in out.scheduled][0] == ("new", 0, 9)


def test_request_that_cannot_grow_even_alone_finishes_with_length():
    sched = make(num_blocks=2, block_size=4)
    sched.add(group("a", 8))
    run_step(sched)
    out = run_step(sched)
    assert [g.request_id for g in out.length_capped] == ["a"]
    assert sched.running == [] and sched.kv.num_free_blocks == 2
    assert sched.kv.num_free_blocks == 2
    assert out.length_capped[0].seqs[0].status is SequenceStatus.FINISHED_LENGTH


def test_all_sequences_of_a_group_are_preempted_together():
    sched = make(num_blocks=6, block_size=4, preemption_mode="recompute")
    sched.add(group("a", 4, arrival=0.0))
    sched.add(group("b", 3, n=3, arrival=1.0))
    run_step(sched)  # a: 1 block; b: its parent prefills 1 block, samples 3 first tokens, forks
    b = next(g for g in sched.running if g.request_id == "b")
    assert len({tuple(sched.kv.block_table(q.seq_id)) for q in b.seqs}) == 1  # shared
    preempted = []
    for _ in range(8):  # a grows a block every 4 tokens; b's 3 sequences copy and grow too
        preempted += [g.request_id for g in run_step(sched).preempted]
        if preempted:
            break
    assert preempted == ["b"]
    assert sched.waiting[0] is b and b.fork_pending
    for q in b.seqs:
        assert q.seq_id not in sched.kv.tables and q.num_computed_tokens == 0
        assert q.status is SequenceStatus.WAITING
    assert [g.request_id for g in sched.running] == ["a"]


def test_max_num_seqs_and_token_budget_limit_admission():
    sched = make(num_blocks=64, block_size=4, max_num_seqs=2)
    for rid in "abc":
        sched.add(group(rid, 2))
    out = run_step(sched)
    assert [s.group.request_id for s in out.scheduled] == ["a", "b"]
    sched = make(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=64,
                 enable_chunked_prefill=False)
    sched.add(group("a", 40))
    sched.add(group("b", 40))
    out = run_step(sched)
    assert [s.group.request_id for s in out.scheduled] == ["a"]
    # With chunked prefill (the default) b takes the rest of the budget as a first chunk.
    sched = make(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    sched.add(group("a", 40))
    sched.add(group("b", 40))
    out = run_step(sched)
    assert [(s.group.request_id, s.num_tokens) for s in out.scheduled] == [("a", 40), ("b", 24)]


def test_budget_below_max_model_len_without_chunked_prefill_is_a_value_error():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=True)


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    sched = make(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_model_len=64,
                 enable_chunked_prefill=True)
    sched.add(group("a", 20))
    chunks = []
    for _ in range(3):
        out = run_step(sched)
        chunks.append([(s.start, s.end, s.do_sample) for s in out.scheduled])
    assert chunks == [[(0, 8, False)], [(8, 16, False)], [(16, 20, True)]]


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make(num_blocks=8, block_size=4)
    sched.add(group("a", 8))
    sched.add(group("b", 30))
    run_step(sched)
    assert sched.abort("a").seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort("b") is not None
    assert sched.abort("zzz") is None
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()


def test_victim_scheduled_earlier_in_the_step_is_swapped_out_with_its_copy_on_write_undone():
    # "new" (arrived later) decodes first in the step and copies its shared last block; then the
    # older "old" needs blocks: "new" is the victim. Its copy is undone and only blocks holding
    # computed K/V go to the CPU pool (a regression: the un-copied target was swapped out).
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_model_len=64,
                                      preemption_mode="swap"),
                      KVCacheManager(6, 4, num_cpu_blocks=16))
    new = group("new", 10, n=2, arrival=1.0)
    sched.add(new)
    sched.add(group("old", 30, arrival=0.0))
    run_step(sched)  # new: its prompt, then it forks (two sequences share 3 blocks); old: 0..2
    held = {b for q in new.seqs for b in sched.kv.block_table(q.seq_id)}
    assert len(held) == 3 and sched.kv.num_free_blocks == 2
    # new's first sequence copies the shared block (1 free left); then old needs 2 blocks.
    allocate = sched.kv.allocate_slots
    copies = []

    def spy(*args):
        made = allocate(*args)
        copies.extend(made)
        return made

    sched.kv.allocate_slots = spy
    out = sched.schedule()
    del sched.kv.allocate_slots
    assert len(copies) == 1  # the copy was made, then undone
    assert [g.request_id for g in out.preempted] == ["new"]
    assert out.blocks_to_copy == []
    assert {src for src, _ in out.blocks_to_swap_out} == held
    assert [(s.group.request_id, s.start, s.end) for s in out.scheduled] == [("old", 2, 12)]
    sched.check_invariants()
    sched.update_from_output(out, fake_results(out))
    # Both sequences of "new" still share their three blocks, now on the CPU.
    cpu = [sched.kv.cpu_tables[q.seq_id].blocks for q in new.seqs]
    assert cpu[0] == cpu[1] and len(cpu[0]) == 3


def test_group_whose_recomputation_exceeds_the_token_budget_still_finishes():
    # Regression: after recomputation every sequence recomputes its own output; the group used
    # to run only when all of them fit one step's budget, and never ran again.
    sched = make(num_blocks=16, block_size=4, max_num_batched_tokens=8, max_model_len=64,
                 preemption_mode="recompute")
    g = group("a", 3, n=4, max_tokens=12)
    sched.add(g)
    for _ in range(6):
        run_step(sched)
    assert all(q.num_output_tokens == 6 for q in g.seqs)
    sched.running.remove(g)  # preempt it by hand: 4 sequences x 8 tokens to recompute
    sched._requeue_for_recompute(g)
    steps = 0
    while sched.has_unfinished():
        out = run_step(sched)
        assert out.num_batched_tokens <= 8
        steps += 1
        assert steps < 100, "the recomputed group never finished"
    assert all(q.num_output_tokens == 12 and q.status is SequenceStatus.FINISHED_LENGTH
               for q in g.seqs)
    assert sched.kv.num_free_blocks == 16


@pytest.mark.parametrize("n", [3, 8])
def test_request_wider_than_max_num_seqs_is_rejected_at_add(n):
    sched = make(max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add(group("wide", 4, n=n))
    sched.add(group("ok", 4, n=2))
    assert [s.group.request_id for s in run_step(sched).scheduled] == ["ok"]


def test_prompt_logprobs_restart_when_a_chunked_prompt_is_recomputed():
    sched = make(num_blocks=8, block_size=4, max_num_batched_tokens=8, max_model_len=64,
                 preemption_mode="recompute")
    g = group("a", 20, prompt_logprobs=1)
    sched.add(g)
    run_step(sched)
    assert len(g.prompt_logprobs) == 1  # the fake runner's observer-less update adds none
    g.prompt_logprobs.extend([{}] * 8)  # as the engine's observer would
    sched.running.remove(g)
    sched._requeue_for_recompute(g)
    assert g.prompt_logprobs == [None] and not g.prompt_logprobs_done
    assert sched.schedule().scheduled[0].wants_prompt_logprobs


def test_swapped_group_that_cannot_come_back_even_into_an_empty_cache_is_recomputed():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                                      preemption_mode="swap"),
                      KVCacheManager(4, 4, num_cpu_blocks=16))
    g = group("a", 8, n=2, max_tokens=4)
    sched.add(g)
    run_step(sched)  # 2 prompt blocks, shared; each sequence has 1 sampled token
    run_step(sched)  # each sequence writes position 8 into its own third block
    assert sched.kv.num_free_blocks == 0
    sched.running.remove(g)
    out = sched.schedule()
    sched._preempt(g, out)
    assert g in sched.swapped
    # 4 distinct blocks + growth: more than the whole cache, so swapping back in is impossible.
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        assert steps < 50
    assert all(q.status is SequenceStatus.FINISHED_LENGTH for q in g.seqs)
    assert sched.kv.num_free_blocks == 4 and sched.kv.num_free_cpu_blocks == 16


def _ids_examined_in_a_step_of_many_victims(num_decoding: int) -> tuple[int, int]:
    """A prefilling request first in queue order takes the blocks of about half of
    `num_decoding` decoding requests that were already scheduled in the same step; returns the
    `id()` calls of that step's `schedule()` (rows looked up by identity) and its victims."""
    import cProfile
    import pstats

    n = num_decoding
    # d* are queued first (admitted first); "a" arrived before them (first in running order).
    sched = make(num_blocks=n + 2, block_size=4, max_num_batched_tokens=3 * n + 4,
                 max_model_len=4 * n, max_num_seqs=n + 1, preemption_mode="recompute")
    for i in range(n):
        sched.add(group(f"d{i}", 3, arrival=1.0 + i, max_tokens=2))
    sched.add(group("a", 2 * n + 8, arrival=0.0, max_tokens=2))
    run_step(sched)  # every d* prefilled, "a" its first 4 tokens
    profiler = cProfile.Profile()
    profiler.enable()
    out = sched.schedule()
    profiler.disable()
    sched.update_from_output(out, fake_results(out))
    sched.check_invariants()
    assert {s.group.request_id for s in out.scheduled} >= {"a"}
    assert all(g.request_id not in {s.group.request_id for s in out.scheduled}
               for g in out.preempted)
    calls = sum(stat[1] for func, stat in pstats.Stats(profiler).stats.items()
                if func[2] == "<built-in method builtins.id>")
    return calls, len(out.preempted)


def test_a_step_with_many_victims_costs_linear_work():
    # Regression (issue 25): each victim already scheduled in the step filtered the step's rows
    # (a pass over all of them per victim: quadratic in a step of many victims).
    small, small_victims = _ids_examined_in_a_step_of_many_victims(64)
    large, large_victims = _ids_examined_in_a_step_of_many_victims(256)
    assert small_victims >= 20 and large_victims >= 4 * small_victims - 8
    assert large <= 5 * small, (small, large)



def _trace_step(sched, out) -> tuple:
    return ([(s.group.request_id, s.seq.index, s.start, s.end, list(s.block_table))
             for s in out.scheduled], list(out.blocks_to_copy), list(out.blocks_to_swap_out),
            list(out.blocks_to_swap_in), [g.request_id for g in out.preempted],
            sched.kv.pool.free_blocks(), sched.kv.cpu_pool.free_blocks())


def _with_decode_path(fast: bool, monkeypatch) -> list[bool]:
    """Turn `Scheduler._decode_one` off (or keep it); the list records what each call did."""
    calls = []
    real = Scheduler._decode_one

    def decode_one(self, *args):
        taken = fast and real(self, *args)
        calls.append(taken)
        return taken

    monkeypatch.setattr(Scheduler, "_decode_one", decode_one)
    return calls


def _lockstep_rows(fast: bool, monkeypatch, seed: int, mode: str) -> tuple:
    """Every step's rows, copies, swaps, victims and free lists of a random workload (one- and
    many-sequence requests, a cache small enough to preempt), with the one-sequence decode path
    on or off."""
    import random

    rng = random.Random(seed)
    calls = _with_decode_path(fast, monkeypatch)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=10, max_num_seqs=12,
                                      preemption_mode=mode, swap_seconds_per_block=1.0,
                                      recompute_seconds_per_token=0.6),
                      KVCacheManager(24, 4, num_cpu_blocks=12))
    trace = []
    for step in range(160):
        if step < 60 and rng.random() < 0.4:
            n = rng.choice([1, 1, 1, 2, 3])
            sched.add(group(f"r{step}", rng.randint(1, 9), n=n, arrival=float(step),
                            max_tokens=rng.randint(2, 20)))
        out = sched.schedule()
        trace.append(_trace_step(sched, out))
        sched.update_from_output(out, fake_results(out, token=rng.randint(0, 99)))
        sched.check_invariants()
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 24
    return trace, calls


def _lockstep_victims(fast: bool, monkeypatch) -> tuple:
    """A prefilling request first in queue order swaps out decoding requests that were already
    scheduled in the same step, each with the new block its decode token took (undone)."""
    calls = _with_decode_path(fast, monkeypatch)
    n = 8
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=4 * n + 4,
                                      max_num_seqs=n + 1, preemption_mode="swap"),
                      KVCacheManager(2 * n + 2, 4, num_cpu_blocks=4 * n))
    for i in range(n):
        sched.add(group(f"d{i}", 4, arrival=1.0 + i, max_tokens=6))
    sched.add(group("a", 2 * n + 30, arrival=0.0, max_tokens=2))
    trace = []
    while sched.has_unfinished():
        out = sched.schedule()
        trace.append(_trace_step(sched, out))
        sched.update_from_output(out, fake_results(out))
        sched.check_invariants()
        assert len(trace) < 100
    return trace, calls, sched.num_undone_victims


@pytest.mark.parametrize(("seed", "mode"), [(0, "recompute"), (1, "auto"), (2, "swap")])
def test_one_sequence_decode_path_schedules_what_the_general_path_schedules(monkeypatch, seed,
                                                                           mode):
    # `Scheduler._decode_one` (issue 25, step cost) must change nothing but the cost: the same
    # rows, block tables, copies, swaps, victims and free lists every step as without it.
    fast, calls = _lockstep_rows(True, monkeypatch, seed, mode)
    slow, _ = _lockstep_rows(False, monkeypatch, seed, mode)
    assert fast == slow
    assert sum(calls) > 100 and not all(calls)  # it took most decode rows, not every one
    assert any(step[4] for step in fast)  # preemptions happened


def test_victims_scheduled_by_the_one_sequence_decode_path_are_undone_exactly(monkeypatch):
    fast, calls, undone = _lockstep_victims(True, monkeypatch)
    slow, _, _ = _lockstep_victims(False, monkeypatch)
    assert fast == slow
    assert undone >= 2 and sum(calls) >= 2 * undone


def test_the_step_budget_grows_with_decode_rows_from_a_floor_to_the_cap():
    """prompt_budget_per_decode_row r: a burst of short prompts starts with 24 r prompt tokens
    a step, not the whole budget; each later step has its decode rows plus r prompt tokens a
    row (at least 24 r), up to max_num_batched_tokens. r = 0: every step takes the cap."""
    def totals(per_row):
        sched = make(num_blocks=200, block_size=4, max_num_seqs=64,
                     prompt_budget_per_decode_row=per_row)
        for i in range(40):
            sched.add(group(f"r{i}", 2))
        return [sum(s.num_tokens for s in run_step(sched).scheduled) for _ in range(4)]

    # rows 0, 12, 24, 36: 24, 12 + 24, 24 + 24, then 36 rows + the last 4 prompts (cap 64)
    assert totals(1) == [24, 36, 48, 36 + 8]
    assert totals(0) == [64, 32 + 16, 40, 40]  # 32 prompts, then 32 rows + the last 8 prompts


def test_the_step_budget_never_splits_the_next_prompt_finer_than_itself():
    """The next prompt in line takes its whole remaining length in one step (up to the cap):
    chunking one long prompt finer than the budget would only add steps."""
    for length, first in ((50, 50), (100, 64)):
        sched = make(num_blocks=64, block_size=4, max_model_len=128, prompt_budget_per_decode_row=1)
        sched.add(group("long", length))
        assert [s.num_tokens for s in run_step(sched).scheduled] == [first]
    with pytest.raises(ValueError, match="prompt_budget_per_decode_row"):
        make(prompt_budget_per_decode_row=-1)


def test_long_prefill_token_threshold_caps_a_prompts_chunk_per_step():
    """vLLM's --long-prefill-token-threshold: a long prompt takes at most that many tokens a
    step, so a short one admitted after it starts in the same step; decode rows are not capped."""
    sched = make(num_blocks=32, block_size=4, long_prefill_token_threshold=8)
    sched.add(group("long", 20))
    sched.add(group("short", 3))
    out = run_step(sched)
    assert [(s.group.request_id, s.num_tokens) for s in out.scheduled] == [("long", 8), ("short", 3)]
    out = run_step(sched)  # decode rows first, then prompt chunks
    assert [(s.group.request_id, s.num_tokens) for s in out.scheduled] == [("short", 1), ("long", 8)]
    run_step(sched)  # the prompt's last 4 tokens
    out = run_step(sched)
    assert sorted((s.group.request_id, s.num_tokens) for s in out.scheduled) == [("long", 1), ("short", 1)]


def _beam_group(rid, prompt_len, width, max_tokens):
    """A beam search request as the engine queues it: one sequence, forked by the beam step."""
    params = SamplingParams(n=width, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            use_beam_search=True)
    g = SequenceGroup(rid, [Sequence(next(_ids), list(range(prompt_len)), 0)], params, 0.0)
    g.beam = BeamState(BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                        ignore_eos=True))
    return g


def _beam_results(out):
    """The fake runner for beams: every row that reaches its sequence's end yields 2 x width
    candidates (distinct tokens, the beams' scores apart)."""
    return [SeqStepOutput(s.seq.seq_id, [], None, beam_candidates=[
                (10 + i, -0.1 * (i + 1) - 0.01 * s.seq.index)
                for i in range(2 * s.group.beam.params.beam_width)] if s.do_sample else None)
            for s in out.scheduled]


def test_beams_swapped_out_while_one_is_parked_by_turns_come_back_and_finish():
    # Regression (a hang the stress harness found, seeds 51238 and 56249): 4 beams on a pool of
    # 5 blocks take turns; swapped out while three held their candidates and the fourth was
    # parked, the group planned no tokens (the parked one is unparked only once running), so
    # it was never swapped back in.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                                      preemption_mode="swap", max_num_seqs=4),
                      KVCacheManager(5, 4, num_cpu_blocks=32))
    g = _beam_group("b", 7, 4, 8)
    sched.add(g)

    def step():
        out = sched.schedule()
        sched.update_from_output(out, _beam_results(out))
        sched.check_invariants()

    while not any(q.parked for q in g.unfinished_seqs()):
        step()
    assert [(q.parked, q.beam_candidates is not None) for q in g.unfinished_seqs()] == \
        [(False, True)] * 3 + [(True, False)]
    sched.running.remove(g)
    sched._preempt(g, sched.schedule())
    assert g in sched.swapped
    steps = 0
    while sched.has_unfinished():
        step()
        steps += 1
        assert steps < 60, "the swapped beams never came back"
    assert len(g.extra["beam_final"]) == 4
    assert all(q.status is SequenceStatus.FINISHED_LENGTH for q in g.seqs)
    assert sched.kv.num_free_blocks == 5 and sched.kv.num_free_cpu_blocks == 32
