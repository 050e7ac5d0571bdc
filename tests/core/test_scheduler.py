"""The scheduler alone (no model): FCFS admission, iteration-level batching, preemption."""

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = iter(range(10**6))


def group(rid, prompt_len, n=1, arrival=0.0):
    params = SamplingParams(n=n, max_tokens=100)
    return SequenceGroup(rid, [Sequence(next(_ids), list(range(prompt_len))) for _ in range(n)],
                         params, arrival)


def run_step(sched):
    """Schedule one step and pretend the model ran: every sampled sequence gains token 7."""
    out = sched.schedule()
    for s in out.scheduled:
        s.seq.num_computed_tokens = s.end
        if s.do_sample:
            s.seq.append_token(7, 0.0)
    sched.kv.check_invariants()
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
    sched = make(num_blocks=6, block_size=4)
    sched.add(group("a", 4, arrival=0.0))
    sched.add(group("b", 4, n=2, arrival=1.0))
    run_step(sched)
    sched.add(group("c", 8, arrival=2.0))
    run_step(sched)  # "a" takes a 2nd block, then b's two seqs each need one: b and c compete
    run_step(sched)
    for g in list(sched.waiting):
        for s in g.seqs:
            assert s.seq_id not in sched.kv.tables
    for g in sched.running:
        assert all(s.seq_id in sched.kv.tables for s in g.unfinished_seqs())


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
