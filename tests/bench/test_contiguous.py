"""The Orca-style contiguous KV manager: first-fit block runs reserved whole at admission, sized
by the paper's policies."""

import random

import pytest

from pagedserve.bench.contiguous import (
    ContiguousAllocator,
    ContiguousKVCacheManager,
    kv_manager_factory,
    reservation_tokens,
)
from pagedserve.core.kv_cache_manager import KVCacheManager, KVManagerConfig


def test_reservation_sizes_per_policy():
    assert reservation_tokens("max", 100, 30, 2048) == 2048
    assert reservation_tokens("oracle", 100, 30, 2048) == 130
    with pytest.raises(ValueError):
        reservation_tokens("best", 5, 5, 2048)


def test_pow2_reserves_the_prompt_plus_the_next_power_of_two_of_the_output():
    # The paper's Orca (Pow2): the output part rounded up to a power of two, the prompt exact
    # (not prompt + output rounded up together: that would be 256 here).
    assert reservation_tokens("pow2", 100, 30, 2048) == 100 + 32
    assert reservation_tokens("pow2", 100, 32, 2048) == 100 + 32
    assert reservation_tokens("pow2", 100, 33, 2048) == 100 + 64
    assert reservation_tokens("pow2", 7, 1, 2048) == 8
    assert reservation_tokens("pow2", 1000, 1000, 2048) == 1000 + 1024
    assert reservation_tokens("pow2", 1500, 540, 2048) == 2048  # capped at max_model_len
    for prompt, out in [(1, 1), (50, 3), (161, 338), (19, 58)]:
        pow2 = reservation_tokens("pow2", prompt, out, 1 << 20)
        assert prompt + out <= pow2 < prompt + 2 * out  # at most 2x over on the output


def test_pow2_manager_reserves_blocks_for_prompt_plus_rounded_output():
    kv = ContiguousKVCacheManager(64, 4, "pow2", max_model_len=256)
    kv.on_admit(0, 10, 10 + 5)  # 10 + 8 = 18 tokens: 5 blocks of 4
    assert kv.num_new_blocks(0, 10) == 5
    kv.check_request(1, False, 10, 15)


def test_admission_reserves_the_whole_range_and_growth_needs_no_blocks():
    kv = ContiguousKVCacheManager(16, 4, "oracle", max_model_len=64)
    kv.on_admit(0, 5, 10)  # 3 blocks of 4
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
    kv.on_finish(0)
    assert kv.pool.num_used == 0 and kv.num_free_blocks == 16 and not kv._lengths
    kv.check_invariants()


def test_free_blocks_is_the_largest_gap_so_external_fragmentation_blocks_admission():
    kv = ContiguousKVCacheManager(12, 1, "oracle", max_model_len=12)
    for seq in range(3):
        kv.on_admit(seq, 1, 4)
        kv.allocate_slots(seq, 1)
    kv.free(0)
    kv.free(2)
    # 8 blocks are free, but in runs of 4 and 4: a request of 6 does not fit.
    assert kv.pool.num_free == 8 and kv.num_free_blocks == 4
    kv.on_admit(3, 1, 6)
    assert kv.num_new_blocks(3, 1) == 6 > kv.num_free_blocks
    kv.check_invariants()


def test_sharing_and_oversized_reservations_are_refused():
    kv = ContiguousKVCacheManager(8, 4, "max", max_model_len=16)
    kv.allocate_slots(0, 3)
    with pytest.raises(ValueError):
        kv.fork(0, 1)
    for n, beam in [(2, False), (1, True)]:
        with pytest.raises(ValueError, match="does not share"):
            kv.check_request(n, beam, 3, 8)
    oracle = ContiguousKVCacheManager(8, 4, "oracle", max_model_len=64)
    oracle.check_request(1, False, 3, 32)  # 8 blocks: fits
    with pytest.raises(ValueError, match="reserves 9 KV blocks"):
        oracle.check_request(1, False, 3, 33)


def test_factory_builds_each_allocator_and_refuses_a_cache_below_one_reservation():
    config = KVManagerConfig(16, 4, num_cpu_blocks=8, enable_prefix_caching=True, max_model_len=64)
    assert kv_manager_factory("paged") is None  # the engine's default: paging
    for policy in ("max", "pow2", "oracle"):
        kv = kv_manager_factory(f"contiguous-{policy}")(config)
        assert kv.policy == policy and kv.cpu_pool is None and not kv.enable_prefix_caching
    with pytest.raises(ValueError, match="reserves 16 blocks"):  # 64 tokens = 16 blocks > 12
        kv_manager_factory("contiguous-max")(KVManagerConfig(12, 4, max_model_len=64))
    with pytest.raises(ValueError, match="allocator"):
        kv_manager_factory("buddy")


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_random_admissions_never_overlap_live_reservations(policy):
    rng = random.Random(7)
    kv = ContiguousKVCacheManager(64, 2, policy, max_model_len=32)
    live: dict[int, int] = {}
    for seq in range(400):
        if live and rng.random() < 0.45:
            kv.on_finish(rng.choice(sorted(live)))
            live = {s: n for s, n in live.items() if s in kv.reservations}
        final = rng.randint(1, 32)
        kv.on_admit(seq, rng.randint(1, final), final)
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
            kv.on_admit(seq, 4, n)  # a no-op for paging
            if kv.num_new_blocks(seq, 4) > kv.num_free_blocks:
                break
            kv.allocate_slots(seq, 4)
            count += 1
        admitted[name] = count
    assert admitted["paged"] >= max(admitted["max"], admitted["pow2"], admitted["oracle"])
    assert admitted["paged"] > admitted["max"]


def test_contiguous_allocator_first_fit_and_coalescing():
    buf = ContiguousAllocator(10)
    a, b, c = buf.allocate(3), buf.allocate(3), buf.allocate(3)
    assert (a, b, c) == (0, 3, 6) and buf.free_gaps() == [1]
    buf.free(a, 3)
    assert buf.allocate(4) is None  # 4 free slots, but no range of 4: external fragmentation
    buf.free(c, 3)
    assert buf.free_gaps() == [3, 4]
    buf.free(b, 3)
    assert buf.free_gaps() == [10]
    with pytest.raises(RuntimeError):
        buf.free(0, 2)  # already free
    with pytest.raises(ValueError):
        buf.allocate(0)
