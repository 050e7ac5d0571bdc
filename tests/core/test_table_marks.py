"""The marks behind the scheduler's step delta (core/step_delta.py): whatever the block manager
does to a table (growth, copy-on-write, truncation, a sliding window's null entries, forks, swaps,
undone allocations), the workers' copy rebuilt from the deltas equals the table, and each delta
sends only what changed; a row's delta carries a request and a sequence once, then new tokens."""

import random

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_spec import FullAttentionSpec, KVLayout, SlidingWindowSpec
from pagedserve.core.sched_types import ScheduledSequence
from pagedserve.core.step_delta import StepDelta, sync_table, take_delta
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup


class Workers:
    """The workers' copy of each table, fed only by deltas (as `StepDecoder` applies them)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv, self.tables, self.sent = kv, {}, []

    def step(self, seq_ids) -> None:
        """Send what changed in these sequences' tables (`take_delta`'s rule for a row)."""
        delta = StepDelta()
        for seq_id in seq_ids:
            sync_table(seq_id, self.kv.tables[seq_id], seq_id not in self.tables, delta)
        for seq_id, keep, new in delta.tables:
            mirror = self.tables.setdefault(seq_id, [])
            del mirror[keep:]
            mirror.extend(new)
        self.sent.append(delta.tables)
        for seq_id in seq_ids:
            assert self.tables[seq_id] == self.kv.tables[seq_id].blocks, seq_id


def test_each_change_sends_only_the_entries_it_changed():
    kv = KVCacheManager(16, 4)
    w = Workers(kv)
    kv.allocate_slots(1, 5)
    w.step([1])
    assert w.sent[-1] == [(1, 0, kv.tables[1].blocks)]  # new: whole
    kv.allocate_slots(1, 6)
    w.step([1])
    assert w.sent[-1] == []  # same blocks: nothing
    kv.allocate_slots(1, 9)
    w.step([1])
    assert w.sent[-1] == [(1, 2, kv.tables[1].blocks[2:])]  # a block appended
    kv.fork(1, 2)
    kv.allocate_slots(1, 10)  # the shared last block: copy-on-write
    w.step([1, 2])
    assert w.sent[-1] == [(1, 2, kv.tables[1].blocks[2:]), (2, 0, kv.tables[2].blocks)]
    kv.allocate_slots(2, 17)  # a row with drafts: their lookahead slots
    w.step([2])
    assert w.sent[-1] == [(2, 3, kv.tables[2].blocks[3:])]
    kv.truncate(2, 10)  # the drafts rejected: their slots given back
    w.step([2])
    assert w.sent[-1] == [(2, 3, [])]
    snap = kv.snapshot(2)
    kv.fork(2, 3)
    kv.allocate_slots(2, 13)  # copy-on-write and a new block, then undone
    kv.restore(2, snap)
    kv.free(3)
    w.step([2])
    assert w.sent[-1] in ([], [(2, 2, kv.tables[2].blocks[2:])])  # (the undone entry, at most)


@pytest.mark.parametrize("seed", range(3))
def test_random_table_changes_keep_the_workers_copy_equal(seed):
    rng = random.Random(seed)
    layout = KVLayout.from_specs([SlidingWindowSpec(1, 8, window=6), FullAttentionSpec(1, 8)])
    kv = KVCacheManager(96, 4, shuffle_seed=seed, num_cpu_blocks=96, layout=layout)
    w = Workers(kv)
    live, next_id = {}, 0  # seq id -> tokens
    for _ in range(300):
        op = rng.choices(range(7), weights=(1, 4, 1, 1, 2, 1, 1))[0]
        if op == 0 or not live:
            if kv.num_free_blocks > 12:
                live[next_id] = 0
                next_id += 1
            continue
        seq_id = rng.choice(sorted(live))
        if seq_id in kv.cpu_tables:
            if op < 3 and kv.num_distinct_blocks([seq_id], cpu=True) <= kv.num_free_blocks:
                kv.swap_in([seq_id])
            continue
        grown = live[seq_id] + rng.randint(1, 6)
        if op == 1 and kv.num_new_blocks(seq_id, grown) <= kv.num_free_blocks:
            live[seq_id] = grown  # (a step's tokens, a chunk, or drafts' lookahead slots)
            kv.allocate_slots(seq_id, grown)
        elif op == 2 and live[seq_id]:  # fork: a beam or a sample
            kv.fork(seq_id, next_id)
            live[next_id] = live[seq_id]
            next_id += 1
        elif op == 3 and live[seq_id] > 1:  # drafts rejected
            live[seq_id] = rng.randint(1, live[seq_id])
            kv.truncate(seq_id, live[seq_id])
        elif op == 4 and live[seq_id]:  # the window moves on
            kv.free_out_of_window(seq_id, live[seq_id])
        elif op == 5 and live[seq_id] and kv.can_swap_out([seq_id]):
            kv.swap_out([seq_id])
        elif op == 6:  # preempted by recomputation, or finished
            kv.free(seq_id)
            if rng.random() < 0.5:
                del live[seq_id]
                w.tables.pop(seq_id, None)
            else:
                live[seq_id] = 0
        device = [s for s in live if s in kv.tables]
        w.step(rng.sample(device, k=min(len(device), 3)))
    # the run made each kind of change: whole tables, entries from an index, cuts
    assert all(any(kind(keep, new) for step in w.sent for _, keep, new in step)
               for kind in (lambda k, n: k == 0, lambda k, n: k and n, lambda k, n: not n))


def test_a_rows_delta_carries_new_requests_new_sequences_and_only_new_tokens():
    kv = KVCacheManager(16, 4)
    params = SamplingParams(n=2, max_tokens=4)
    group = SequenceGroup("r", [Sequence(1, [5, 6, 7]), Sequence(2, [5, 6, 7], 1)], params, 0.0)

    def step(end, num_samples=1):
        seq = group.seqs[0]
        kv.allocate_slots(1, end)
        row = ScheduledSequence(group, seq, 0, end, kv.tables[1].blocks, True, False,
                                num_samples)
        return take_delta([row], kv, StepDelta())

    first = step(3, num_samples=2)  # the parent's prompt, sampling for both sequences
    assert [r for r, _, _ in first.new_requests] == ["r"]
    assert first.new_seqs == [(1, "r", 3, 0), (2, "r", 3, 1)]
    assert first.tokens == [(1, 0, [5, 6, 7]), (2, 0, [5, 6, 7])]
    group.seqs[0].token_ids.append(9)
    second = step(4)
    assert (second.new_requests, second.new_seqs, second.tokens) == ([], [], [(1, 3, [9])])
    assert second.tables == []  # the same block
    del group.seqs[0].token_ids[3:]  # a list cut back (none is today): cut back on the workers
    assert step(4).tokens == [(1, 3, [])]
