"""The block manager with a recurrent state group (`RecurrentStateSpec`: Gated DeltaNet / Mamba
layers' state in cache entries): one block per sequence in the first logical block of each state
column, null entries below, copy-on-write before every step that writes a shared state, no
prefix caching; swaps, forks and undo keep the invariants and return the pool to empty."""

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


def test_prefix_caching_and_sibling_sharing_are_off_with_a_state():
    kv = _manager(enable_prefix_caching=True)
    assert not kv.enable_prefix_caching
    kv.allocate_slots(0, 12)
    kv.cache_full_blocks(0, list(range(12)), 12)
    assert kv.match_prefix(list(range(13))) == []
    assert kv.shareable_prefix(0, 2) == []


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
