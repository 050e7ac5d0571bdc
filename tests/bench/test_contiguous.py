"""The Orca-style contiguous KV manager: first-fit block runs reserved whole at admission."""

import random

import pytest

from pagedserve.core.contiguous import ContiguousKVCacheManager, reservation_tokens
from pagedserve.core.kv_cache_manager import KVCacheManager


def test_reservation_sizes_per_policy():
    assert reservation_tokens("max", 130, 2048) == 2048
    assert reservation_tokens("oracle", 130, 2048) == 130
    assert reservation_tokens("pow2", 130, 2048) == 256
    assert reservation_tokens("pow2", 2000, 2048) == 2048
    with pytest.raises(ValueError):
        reservation_tokens("best", 10, 2048)


def test_admission_reserves_the_whole_range_and_growth_needs_no_blocks():
    kv = ContiguousKVCacheManager(16, 4, "oracle", max_model_len=64)
    kv.expect_length(0, 10)  # 3 blocks of 4
    assert kv.num_new_blocks(0, 5) == 3
    kv.allocate_slots(0, 5)
    assert kv.block_table(0) == [0, 1] and kv.reservations[0] == (0, 3)
    assert kv.num_new_blocks(0, 9) == 0
    kv.allocate_slots(0, 9)
    assert kv.block_table(0) == [0, 1, 2]
    assert kv.pool.num_used == 3 and kv.num_free_blocks == 13
    kv.check_invariants()
    with pytest.raises(RuntimeError):
        kv.allocate_slots(0, 13)  # past its reservation: a scheduler bug
    kv.forget(0)
    assert kv.pool.num_used == 0 and kv.num_free_blocks == 16
    kv.check_invariants()


def test_free_blocks_is_the_largest_gap_so_external_fragmentation_blocks_admission():
    kv = ContiguousKVCacheManager(12, 1, "oracle", max_model_len=12)
    for seq in range(3):
        kv.expect_length(seq, 4)
        kv.allocate_slots(seq, 1)
    kv.free(0)
    kv.free(2)
    # 8 blocks are free, but in runs of 4 and 4: a request of 6 does not fit.
    assert kv.pool.num_free == 8 and kv.num_free_blocks == 4
    kv.expect_length(3, 6)
    assert kv.num_new_blocks(3, 1) == 6 > kv.num_free_blocks
    kv.check_invariants()


def test_sharing_is_refused():
    kv = ContiguousKVCacheManager(8, 4, "max", max_model_len=16)
    kv.allocate_slots(0, 3)
    with pytest.raises(ValueError):
        kv.fork(0, 1)


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_random_admissions_never_overlap_live_reservations(policy):
    rng = random.Random(7)
    kv = ContiguousKVCacheManager(64, 2, policy, max_model_len=32)
    live: dict[int, int] = {}
    for seq in range(400):
        if live and rng.random() < 0.45:
            kv.forget(rng.choice(sorted(live)))
            live = {s: n for s, n in live.items() if s in kv.reservations}
        final = rng.randint(1, 32)
        kv.expect_length(seq, final)
        if kv.num_new_blocks(seq, 1) <= kv.num_free_blocks:
            kv.allocate_slots(seq, 1)
            live[seq] = final
        for s, n in live.items():  # grow everyone a little, inside their reservation
            kv.allocate_slots(s, min(n, kv.tables[s].num_tokens + rng.randint(0, 3)))
        kv.check_invariants()
        blocks = [b for s in live for b in range(*_span(kv.reservations[s]))]
        assert len(blocks) == len(set(blocks))


def _span(res):
    start, size = res
    return start, start + size


def test_paged_admits_at_least_as_many_as_contiguous_at_the_same_budget():
    lengths = [random.Random(3).randint(5, 60) for _ in range(50)]
    admitted = {}
    for name in ("paged", "max", "pow2", "oracle"):
        kv = (KVCacheManager(64, 4) if name == "paged"
              else ContiguousKVCacheManager(64, 4, name, max_model_len=64))
        count = 0
        for seq, n in enumerate(lengths):  # prompt of 4 tokens, n in all
            if name != "paged":
                kv.expect_length(seq, n)
            if kv.num_new_blocks(seq, 4) > kv.num_free_blocks:
                break
            kv.allocate_slots(seq, 4)
            count += 1
        admitted[name] = count
    assert admitted["paged"] >= max(admitted["max"], admitted["pow2"], admitted["oracle"])
    assert admitted["paged"] > admitted["max"]
