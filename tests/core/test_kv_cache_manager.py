"""The block manager: on-demand allocation, sharing by reference counts, copy-on-write, freeing."""

import pytest
from hypothesis import given, settings, strategies as st

from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv


def test_prompt_takes_ceil_blocks_and_grows_only_when_last_block_fills():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(0, 6)
    assert len(kv.block_table(0)) == 2
    kv.allocate_slots(0, 7)
    kv.allocate_slots(0, 8)
    assert len(kv.block_table(0)) == 2
    kv.allocate_slots(0, 9)
    assert len(kv.block_table(0)) == 3
    kv.free(0)
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_fork_shares_blocks_and_write_into_shared_partial_block_copies_it():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(0, 6)
    kv.fork(0, 1)
    shared = kv.block_table(0)
    assert kv.block_table(1) == shared
    assert all(kv.pool.ref_counts[b] == 2 for b in shared)
    assert kv.num_new_blocks(1, 7) == 1
    copies = kv.allocate_slots(1, 7)
    assert copies == [(shared[1], kv.block_table(1)[1])]
    assert kv.block_table(1)[0] == shared[0]
    assert kv.pool.ref_counts[shared[1]] == 1
    # The last holder writes in place.
    assert kv.allocate_slots(0, 7) == []
    kv.check_invariants()
    kv.free(0)
    kv.free(1)
    assert kv.num_free_blocks == 10


def test_full_shared_last_block_needs_no_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(0, 8)
    kv.fork(0, 1)
    assert kv.allocate_slots(1, 9) == []
    assert kv.block_table(1)[:2] == kv.block_table(0)
    kv.check_invariants()


def _lose_a_returned_block(kv):
    kv.allocate_slots(1, 4)
    block = kv.block_table(1)[0]
    kv.free(1)
    kv.pool._free.pop(block)


@pytest.mark.parametrize("corrupt,message", [
    (lambda kv, held: kv.pool.ref_counts.__setitem__(held, 2), "ref count 2, held by 1"),
    (lambda kv, held: kv.pool.ref_counts.__setitem__(7, 1), "block 7: ref count 1, held by 0"),
    (lambda kv, held: kv.pool._free.__setitem__(held, None), "ref count 1 but free=True"),
    (lambda kv, held: kv.pool._taken_early.add(7), "block 7: ref count 0 but free=False"),
    (lambda kv, held: _lose_a_returned_block(kv), "ref count 0 but free=False"),
    (lambda kv, held: kv.tables[0].blocks.pop(), "1 blocks for 6 slots"),
])
def test_invariant_check_catches_each_disagreement_between_pool_and_tables(corrupt, message):
    # NOTE: the check works by counts beyond the held blocks (a swap pool holds ~10^6 blocks);
    # each kind of corruption must still be named.
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate_slots(0, 6)
    held = kv.block_table(0)[-1]
    assert 7 not in kv.block_table(0)
    kv.check_invariants()
    corrupt(kv, held)
    with pytest.raises(RuntimeError, match=message):
        kv.check_invariants()


def test_invariant_check_of_a_large_swap_pool_costs_its_held_blocks_not_its_size():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=1 << 20)
    kv.allocate_slots(0, 6)
    calls = []
    real = kv.cpu_pool.is_free
    kv.cpu_pool.is_free = lambda b: calls.append(b) or real(b)
    kv.check_invariants()
    assert calls == []


def test_nothing_is_swapped_out_without_a_cpu_pool_not_even_a_sequence_holding_no_block():
    # Regression (the scheduler fuzzer, tests/core/test_scheduler_fuzz.py): a running beam
    # with an empty table (unparked, not yet computing) was "swapped" into CPU tables with no
    # pool behind them, and freeing it later crashed.
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.share_blocks(0, [], None)  # an empty table, as an unparked sequence gets
    assert kv.block_table(0) == []
    assert not kv.can_swap_out([0])
    kv.free(0)
    with_pool = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    with_pool.share_blocks(0, [], None)
    assert with_pool.can_swap_out([0])
    assert with_pool.swap_out([0]) == []
    with_pool.free(0)
    assert with_pool.num_free_cpu_blocks == 4


def test_block_size_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=257)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "fork", "free"]), st.integers(0, 7),
              st.integers(1, 9)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 16]), shuffle=st.booleans())
def test_random_allocate_append_fork_free_keeps_invariants(ops, block_size, shuffle):
    num_blocks = 24
    kv = KVCacheManager(num_blocks, block_size, shuffle_seed=1 if shuffle else None)
    for op, seq, n in ops:
        table = kv.tables.get(seq)
        if op == "alloc" and table is None:
            if kv.num_new_blocks(seq, n) <= kv.num_free_blocks:
                kv.allocate_slots(seq, n)
        elif op == "append" and table is not None:
            target = table.num_tokens + n
            need = kv.num_new_blocks(seq, target)
            if need <= kv.num_free_blocks:
                before = kv.num_free_blocks
                kv.allocate_slots(seq, target)
                assert before - kv.num_free_blocks == need
                assert len(kv.block_table(seq)) == cdiv(target, block_size)
        elif op == "fork" and table is not None:
            child = (seq + n) % 8
            if child not in kv.tables:
                kv.fork(seq, child)
        elif op == "free":
            kv.free(seq)
        kv.check_invariants()
        free = set(kv.pool.free_blocks())
        used = {b for t in kv.tables.values() for b in t.blocks}
        assert not free & used
        assert len(free) + len(used) == num_blocks
    for seq in list(kv.tables):
        kv.free(seq)
    assert kv.num_free_blocks == num_blocks
    assert all(c == 0 for c in kv.pool.ref_counts)


def test_prefix_cache_reuses_full_blocks_checks_tokens_and_forgets_evicted_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    kv.allocate_slots(0, 5)
    kv.cache_full_blocks(0, tokens, 5)
    first_two = kv.block_table(0)[:2]
    assert kv.match_prefix(tokens) == first_two
    assert kv.match_prefix([1, 2, 3, 4]) == first_two[:1]  # the last token is always recomputed
    assert kv.match_prefix([1, 2, 9, 9, 9]) == first_two[:1]
    # A hash that matches with other tokens is not trusted.
    block = first_two[1]
    h, parent, _, column = kv._block_key[block]
    kv._block_key[block] = (h, parent, (7, 7), column)
    assert kv.match_prefix(tokens) == first_two[:1]
    kv._block_key[block] = (h, parent, (3, 4), column)
    kv.free(0)
    assert kv.num_free_blocks == 4 and kv.match_prefix(tokens) == first_two  # kept while free
    kv.use_prefix(1, first_two)
    assert kv.num_free_blocks == 2
    kv.check_invariants()
    kv.free(1)
    for seq in range(2, 6):  # hand every block out again: the cache forgets them
        kv.allocate_slots(seq, 2)
    assert kv.match_prefix(tokens) == []


def test_cache_salt_isolates_prefix_hits_between_salts():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    kv.allocate_slots(0, 5)
    kv.cache_full_blocks(0, tokens, 5, salt="alice")
    salted = kv.block_table(0)[:2]
    assert kv.match_prefix(tokens, "alice") == salted
    assert kv.match_prefix(tokens, "bob") == [] and kv.match_prefix(tokens) == []
    kv.allocate_slots(1, 5)
    kv.cache_full_blocks(1, tokens, 5)  # the same tokens, unsalted: their own blocks
    plain = kv.block_table(1)[:2]
    assert kv.match_prefix(tokens) == plain and not set(plain) & set(salted)
    assert kv.match_prefix(tokens, "alice") == salted


def test_a_hash_collision_never_hands_a_request_another_chains_blocks(monkeypatch):
    # A hash that ignores the parent makes every chain's block of the same tokens collide: two
    # tenants (cache_salt) with the same prompt, and a block following other tokens.
    import pagedserve.core.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: hash(tokens))
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots(0, 5)
    kv.cache_full_blocks(0, [1, 2, 3, 4, 5], 5, salt="tenant-a")
    assert len(kv.match_prefix([1, 2, 3, 4, 5], salt="tenant-a")) == 2
    assert kv.match_prefix([1, 2, 3, 4, 5], salt="tenant-b") == []
    assert kv.match_prefix([1, 2, 3, 4, 5]) == []
    kv.allocate_slots(1, 5)
    kv.cache_full_blocks(1, [9, 9, 3, 4, 5], 5)  # block (3, 4) after (9, 9): its hash collides
    assert kv.match_prefix([1, 2, 3, 4, 5], salt="tenant-a") == kv.block_table(0)[:2]
    assert kv.match_prefix([9, 9, 3, 4, 5]) == kv.block_table(1)[:1]
