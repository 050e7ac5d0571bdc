"""scheduling_policy="priority": a lower priority value is admitted first (ties by arrival), the
lowest-priority running request is preempted first, and under fcfs a non-zero priority is
refused naming --scheduling-policy."""

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.sequence import SequenceStatus
from test_scheduler import group, run_step


def make(policy, num_blocks=8, block_size=4, **cfg):
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("max_num_batched_tokens", 64)
    return Scheduler(SchedulerConfig(scheduling_policy=policy, **cfg),
                     KVCacheManager(num_blocks, block_size))


def prioritized(rid, prompt_len, priority, arrival, **params):
    g = group(rid, prompt_len, arrival=arrival, **params)
    g.priority = priority
    return g


def test_lower_priority_values_are_admitted_first_and_ties_go_by_arrival():
    sched = make("priority", num_blocks=4)
    for rid, prio, arrival in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 0, 2.0), ("d", -1, 3.0)]:
        sched.add(prioritized(rid, 12, prio, arrival))  # 3 blocks each: one at a time
    admitted = []
    while sched.has_unfinished():
        out = run_step(sched)
        admitted += [s.group.request_id for s in out.scheduled if s.start == 0]
        for g in list(sched.running):  # finish whatever ran, to let the next one in
            for q in g.seqs:
                sched.finish_seq(q, SequenceStatus.FINISHED_LENGTH)
        sched.remove_finished()
    assert admitted == ["d", "b", "c", "a"]


def test_fcfs_admits_by_arrival_whatever_the_priority_field_says():
    sched = make("fcfs", num_blocks=4)
    for rid in "abc":
        sched.add(group(rid, 12))
    assert [g.request_id for g in sched.waiting] == ["a", "b", "c"]


@pytest.mark.parametrize("policy,victim", [("priority", "old-low"), ("fcfs", "new-high")])
def test_the_lowest_priority_running_request_is_preempted_first(policy, victim):
    # Both run; the pool is full when the next decode tokens need blocks. Under priority the
    # victim is the low-priority request even though it arrived first; under fcfs the newest.
    sched = make(policy, num_blocks=4, block_size=4)
    low = prioritized("old-low", 8, 5 if policy == "priority" else 0, 0.0)
    high = prioritized("new-high", 7, 0, 1.0)
    sched.add(low)
    sched.add(high)
    run_step(sched)  # both prefilled: 2 + 2 blocks, every block in use
    assert sched.kv.num_free_blocks == 0 and len(sched.running) == 2
    preempted = []
    for _ in range(4):
        out = run_step(sched)
        preempted += [g.request_id for g in out.preempted]
        if preempted:
            break
    assert preempted == [victim]
    assert [g.request_id for g in sched.running] == [r for r in ("new-high", "old-low")
                                                     if r != victim]


def test_a_preempted_request_comes_back_by_its_priority_ahead_of_lower_ones():
    sched = make("priority", num_blocks=4, block_size=4)
    sched.add(prioritized("mid", 8, 1, 0.0))
    sched.add(prioritized("top", 7, 0, 1.0))
    run_step(sched)
    sched.add(prioritized("bottom", 4, 9, 2.0))
    while not any(g.num_preemptions for g in sched.waiting):
        run_step(sched)
    assert [g.request_id for g in sched.waiting] == ["mid", "bottom"]


def test_fcfs_refuses_a_non_zero_priority_naming_the_option():
    sched = make("fcfs")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        sched.add(prioritized("a", 4, 1, 0.0))
    assert not sched.has_unfinished()
    sched.add(prioritized("b", 4, 0, 0.0))  # priority 0 is fine
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")


def test_a_higher_priority_request_is_admitted_while_a_lower_group_takes_turns():
    # "wide": 4 sequences that cannot all hold their blocks in 6 (one at a time they fit): they
    # take turns, and new requests of its priority or lower wait for the turns to end; one of
    # a higher priority does not.
    sched = make("priority", num_blocks=6, block_size=4)
    wide = group("wide", 4, n=4, arrival=0.0, max_tokens=12)
    wide.priority = 5
    sched.add(wide)
    while not wide.parked_seqs():
        run_step(sched)
    sched.add(prioritized("new", 2, 0, 1.0))
    admitted_during_turns = False
    while sched.has_unfinished():
        turns = bool(wide.parked_seqs()) and wide in sched.running
        run_step(sched)
        if turns and any(g.request_id == "new" for g in sched.running):
            admitted_during_turns = True
    assert admitted_during_turns
    assert sched.kv.num_free_blocks == 6
