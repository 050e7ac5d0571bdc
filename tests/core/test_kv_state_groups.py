"""The block manager with a recurrent state group (`RecurrentStateSpec`: Gated DeltaNet / Mamba
layers' state in cache entries): one block per sequence in the first logical block of each state
column, null entries below, copy-on-write before every step that writes a shared state;
prefix caching by snapshots of the state at block boundaries (core/state_snapshots.py); a
speculative row's state kept until its drafts are verified (core/state_rollback.py); swaps,
forks and undo keep the invariants and return the pool to empty."""

import random

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_spec import FullAttentionSpec, KVLayout, RecurrentStateSpec

FULL = FullAttentionSpec(1, 8)
STATE = RecurrentStateSpec(1, 8)


def _manager(num_blocks=200, block_size=4, attention=2, state=5, **kw):
    # a hybrid model: each recurrent layer's state spans several entries (here `state` in all)
    layout = KVLayout.from_specs([FULL] * attention + [STATE] * state)
    return KVCacheManager(num_blocks, block_size, layout=layout, **kw)


def test_state_entries_form_their_own_group_of_one_block_per_sequence():
    layout = KVLayout.from_specs([FULL, STATE, STATE, FULL, STATE, STATE])
    assert [g.name for g in layout.groups] == ["full", "state"]
    assert layout.slots == 2 and layout.width == 3
    # 40 tokens of 4 a block: 10 blocks of the full lane, 2 of the state lanes whatever the length
    assert layout.blocks_per_request(40, 4, 8) == 12
    assert layout.blocks_per_request(4000, 4, 8) == 1002
    # one group of full attention (hybrid off): the state entries keep every block
    assert KVLayout.from_specs([FULL, STATE], hybrid=False).groups[0].spec == FULL


def test_only_the_first_logical_block_holds_state_blocks():
    kv = _manager()
    w = kv.width
    state_cols = kv._state_cols
    full = w - len(state_cols)
    assert (full, len(state_cols)) == (2, 5)  # (one layer per block: 2 full lanes, 5 state)
    assert kv.num_new_blocks(0, 9) == 3 * full + len(state_cols)  # 3 rows
    kv.allocate_slots(0, 9)
    blocks = kv.block_table(0)
    assert all(blocks[c] != kv.null for c in range(w))
    assert all(blocks[r * w + c] == kv.null for r in (1, 2) for c in state_cols)
    assert kv.pool.num_used == 3 * full + len(state_cols)
    assert kv.num_new_blocks(0, 13) == full  # a new row: its full columns only
    assert kv.allocate_slots(0, 13) == []
    kv.check_invariants()
    assert kv.blocks_for(13, 13) >= kv.pool.num_used


def test_a_forked_state_is_copied_before_the_step_that_writes_it_and_undo_restores_it():
    kv = _manager()
    kv.allocate_slots(0, 8)  # two full rows
    kv.fork(0, 1)
    kv.check_invariants()
    free = kv.num_free_blocks
    snap = kv.snapshot(1)
    # the next token starts a new row: no partial block to copy, but the state is rewritten
    full = kv.width - len(kv._state_cols)
    assert kv.num_new_blocks(1, 9) == full + len(kv._state_cols)
    copies = kv.allocate_slots(1, 9)
    assert sorted(src for src, _ in copies) == sorted(kv.block_table(0)[c] for c in kv._state_cols)
    assert kv.num_free_blocks == free - full - len(kv._state_cols)
    kv.check_invariants()
    kv.restore(1, snap)  # (the step that would have run it is undone)
    assert kv.block_table(1) == kv.block_table(0) and kv.num_free_blocks == free
    kv.check_invariants()
    kv.allocate_slots(1, 9)
    # the parent now holds its state alone: it writes in place, no copy
    assert kv.num_new_blocks(0, 9) == full and kv.allocate_slots(0, 9) == []
    kv.free(0)
    kv.free(1)
    assert kv.pool.num_used == 0
    kv.check_invariants()


def test_a_fork_inside_the_first_row_copies_each_shared_block_once():
    kv = _manager()
    kv.allocate_slots(0, 3)  # one partial row: the last row IS the state row
    kv.fork(0, 1)
    assert kv.num_new_blocks(1, 4) == kv.width
    copies = kv.allocate_slots(1, 4)
    assert len(copies) == kv.width and len({d for _, d in copies}) == kv.width
    kv.check_invariants()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("start", [3, 6, 8])
def test_a_speculative_row_keeps_its_state_until_the_drafts_are_verified(start, shared):
    # a row from `start` with three drafts: its state blocks are copied (the step writes the
    # copies), the ones it held kept; all accepted -> the new ones stay, else the old come back
    for keep in (True, False):
        kv = _manager()
        kv.allocate_slots(0, start)
        if shared:
            kv.fork(0, 1)
        state = kv._state_cols
        before = [kv.block_table(0)[c] for c in state]
        need = kv.num_new_blocks(0, start + 4, keep_state=True)
        assert need == kv.num_new_blocks(0, start + 4) + (0 if shared else len(state))
        free, snap = kv.num_free_blocks, kv.snapshot(0)
        copies = kv.allocate_slots(0, start + 4, keep_state=True)
        assert free - kv.num_free_blocks == need
        after = [kv.block_table(0)[c] for c in state]
        assert set(zip(before, after)) <= set(copies) and not set(before) & set(after)
        kv.check_invariants()  # (the backups count as the manager's)
        assert kv.has_state_backup(0)
        if keep:  # (undoing the allocation gives everything back first, once)
            kv.restore(0, snap)
            assert [kv.block_table(0)[c] for c in state] == before and kv.num_free_blocks == free
            kv.check_invariants()
            kv.allocate_slots(0, start + 4, keep_state=True)
            after = [kv.block_table(0)[c] for c in state]
        assert kv.settle_state(0, keep_new=keep) is keep and not kv.has_state_backup(0)
        assert [kv.block_table(0)[c] for c in state] == (after if keep else before)
        assert kv.state_rollbacks == (0 if keep else 1)
        kv.truncate(0, start + 2)
        kv.check_invariants()
        kv.free(0)
        kv.free(1)
        assert kv.pool.num_used == 0


def test_a_sequence_freed_with_its_speculative_row_pending_gives_the_backup_back():
    kv = _manager()
    kv.allocate_slots(0, 5)
    kv.allocate_slots(0, 9, keep_state=True)
    with pytest.raises(RuntimeError, match="swapped with its speculative row"):
        kv.swap_out([0])
    kv.free(0)
    assert kv.pool.num_used == 0 and not kv.has_state_backup(0)
    kv.check_invariants()


def _step(kv, seq_id, tokens, start, end):
    """Schedule `seq_id` for tokens [start, end) as the scheduler does (slots, then the step's
    snapshots from the blocks left free), run it (the copies), apply it (cache its blocks)."""
    copies = kv.allocate_slots(seq_id, end) + kv.take_hit_copies()
    copies += kv.take_snapshots([(seq_id, tokens, start, None)], copies)
    kv.check_invariants()
    kv.cache_full_blocks(seq_id, tokens, end)
    kv.end_step()
    kv.check_invariants()
    return copies


def test_a_state_snapshot_is_taken_at_a_block_boundary_and_a_later_prompt_starts_from_it():
    kv = _manager(enable_prefix_caching=True)
    assert kv.snapshots_state
    state = kv._state_cols
    tokens = list(range(100, 130))
    # no snapshot inside a step, nor at the first block's end (its row holds the live state)
    assert [c for c in _step(kv, 0, tokens, 0, 4)] == []
    assert _step(kv, 0, tokens, 4, 11) == []
    assert kv.match_prefix(tokens[:13]) == []  # (no snapshot: no hit, whatever the KV blocks)
    # the next step starts past a partial block: none; the one after starts at 12: one
    assert _step(kv, 0, tokens, 11, 12) == []
    live = [kv.block_table(0)[c] for c in state]
    used = kv.pool.num_used
    copies = _step(kv, 0, tokens, 12, 13)
    assert [src for src, _ in copies] == live and len(copies) == len(state)
    snaps = [dst for _, dst in copies]
    # unpinned after the step: cached on the free list, the pool's use that of the new row
    assert kv.pool.num_used == used + kv.width - len(state) and all(kv.pool.is_free(b) for b in snaps)
    # a later prompt sharing the first 12 tokens starts from the snapshot
    prompt = tokens[:12] + [7, 8, 9]
    hit = kv.match_prefix(prompt)
    w = kv.width
    assert len(hit) == 3 * w and [hit[2 * w + c] for c in state] == snaps
    assert all(hit[r * w + c] == kv.null for r in (0, 1) for c in state)
    need = kv.num_blocks_to_map(15, hit)
    free = kv.num_free_blocks
    assert kv.use_prefix(1, hit) == 12
    kv.check_invariants()
    table = kv.block_table(1)
    assert all(table[2 * w + c] == kv.null for c in state)  # (the snapshot is out of the table)
    fresh = [table[c] for c in state]
    assert kv.take_hit_copies() == list(zip(snaps, fresh))  # (this step's, computing or not)
    assert kv.take_hit_copies() == []
    assert kv.allocate_slots(1, 15) == []
    assert free - kv.num_free_blocks == need
    kv.check_invariants()
    kv.end_step()
    kv.free(0)
    kv.free(1)
    assert kv.pool.num_used == 0
    kv.check_invariants()


def test_a_snapshot_never_takes_a_block_the_step_needs_and_an_evicted_one_does_not_hit():
    kv = _manager(num_blocks=40, enable_prefix_caching=True)
    tokens = list(range(100, 140))
    _step(kv, 0, tokens, 0, 8)
    kv.allocate_slots(1, 44)  # (another sequence takes the pool: 11 rows, 27 blocks)
    assert kv.num_free_blocks == 4 and kv.num_new_blocks(0, 9) == 2
    assert _step(kv, 0, tokens, 8, 9) == []  # no room: no snapshot, nothing preempted
    kv.free(1)
    copies = _step(kv, 0, tokens, 9, 12)
    copies = _step(kv, 0, tokens, 12, 13)
    assert len(copies) == len(kv._state_cols)
    kv.free(0)
    assert len(kv.match_prefix(tokens[:14])) == 3 * kv.width
    # one state column's snapshot handed out again: the prefix no longer hits
    victim = copies[0][1]
    while True:
        b = kv.pool.allocate(kv.pool.tags[victim])
        if b == victim:
            break
    assert kv.match_prefix(tokens[:14]) == []
    assert kv.shareable_prefix(0, 2) == []  # (siblings share no state through the tables)


def test_a_sequence_freed_before_its_snapshot_copy_gives_the_snapshot_back():
    kv = _manager(enable_prefix_caching=True)
    tokens = list(range(100, 130))
    _step(kv, 0, tokens, 0, 12)
    _step(kv, 0, tokens, 12, 13)
    kv.free(0)
    hit = kv.match_prefix(tokens[:14])
    kv.use_prefix(1, hit)
    kv.check_invariants()  # (the pinned snapshot counts as held)
    kv.restore(1, None)  # undone before its step: the snapshot unpinned, the live blocks freed
    assert kv.take_hit_copies() == [] and kv.pool.num_used == 0
    kv.check_invariants()


def test_a_sequence_swapped_out_in_the_step_of_its_hit_takes_its_state_from_the_snapshot():
    kv = _manager(enable_prefix_caching=True, num_cpu_blocks=100)
    tokens = list(range(100, 130))
    _step(kv, 0, tokens, 0, 12)
    snaps = [dst for _, dst in _step(kv, 0, tokens, 12, 13)]
    kv.free(0)
    kv.use_prefix(1, kv.match_prefix(tokens[:14]))
    live = [kv.block_table(1)[c] for c in kv._state_cols]
    pairs = dict(kv.swap_out([1]))  # (preempted in the same step: its copy has not run)
    assert all(b not in pairs for b in live) and all(s in pairs for s in snaps)
    assert kv.take_hit_copies() == []
    kv.check_invariants()
    kv.end_step()
    kv.free(1)
    assert kv.pool.num_used == 0 and kv.cpu_pool.num_used == 0


def test_swap_moves_the_state_blocks_and_keeps_the_null_entries():
    kv = _manager(num_cpu_blocks=100)
    kv.allocate_slots(0, 10)
    held = kv.pool.num_used
    assert len(kv.swap_out([0])) == held and kv.pool.num_used == 0
    kv.check_invariants()
    assert len(kv.swap_in([0])) == held
    kv.check_invariants()
    blocks = kv.block_table(0)
    assert [blocks[kv.width + c] for c in kv._state_cols] == [kv.null] * len(kv._state_cols)


def test_invariants_catch_a_state_block_below_the_first_row():
    kv = _manager()
    kv.allocate_slots(0, 5)
    c = kv._state_cols[0]
    kv.tables[0].blocks[kv.width + c] = kv.tables[0].blocks[c]
    with pytest.raises(RuntimeError, match="first row only"):
        kv.check_invariants()


@pytest.mark.parametrize("seed", range(8))
def test_random_grow_fork_undo_swap_free_keeps_invariants_and_predictions(seed):
    rng = random.Random(seed)
    kv = _manager(num_blocks=400, block_size=rng.choice([1, 2, 4]), state=rng.randint(1, 6),
                  attention=rng.randint(1, 3), num_cpu_blocks=400, shuffle_seed=seed)
    lens: dict[int, int] = {}
    swapped: dict[int, int] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.2 or not lens:
            n = rng.randint(1, 12)
            assert kv.num_new_blocks(next_id, n) == kv.blocks_for(n, n)
            if kv.blocks_for(n, n) > kv.num_free_blocks:
                continue
            before = kv.num_free_blocks
            kv.allocate_slots(next_id, n)
            assert before - kv.num_free_blocks == kv.blocks_for(n, n)
            lens[next_id] = n
            next_id += 1
        elif op < 0.6:
            s = rng.choice(list(lens))
            n = lens[s] + rng.randint(1, 5)
            need, before = kv.num_new_blocks(s, n), kv.num_free_blocks
            if need > before:
                continue
            snap = kv.snapshot(s)
            copies = kv.allocate_slots(s, n)
            assert before - kv.num_free_blocks == need
            assert all(kv.pool.ref_counts[src] >= 1 for src, _ in copies)
            if rng.random() < 0.3:
                kv.restore(s, snap)
                assert kv.num_free_blocks == before
            else:
                lens[s] = n
        elif op < 0.75:
            parent = rng.choice(list(lens))
            kv.fork(parent, next_id)
            lens[next_id] = lens[parent]
            next_id += 1
        elif op < 0.85:
            s = rng.choice(list(lens))
            if kv.can_swap_out([s]):
                kv.swap_out([s])
                swapped[s] = lens.pop(s)
        elif op < 0.92 and swapped:
            s = rng.choice(list(swapped))
            if kv.num_distinct_blocks([s], cpu=True) + kv.num_swap_in_growth(s, swapped[s]) \
                    <= kv.num_free_blocks:
                kv.swap_in([s])
                lens[s] = swapped.pop(s)
        else:
            s = rng.choice(list(lens))
            kv.free(s)
            del lens[s]
        kv.check_invariants()
    for s in list(lens) + list(swapped):
        kv.free(s)
    kv.check_invariants()
    assert kv.pool.num_used == 0 and kv.cpu_pool.num_used == 0


def test_an_empty_table_grows_its_first_row_with_the_state():
    kv = _manager()
    kv.allocate_slots(0, 0)  # (a table with no slots yet)
    assert kv.num_new_blocks(0, 3) == kv.width
    kv.allocate_slots(0, 3)
    assert kv.pool.num_used == kv.width
    kv.check_invariants()
