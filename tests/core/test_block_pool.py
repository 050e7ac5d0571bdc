"""The block pool: reference counts and the free list."""

import pytest

from pagedserve.core.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_until_empty_then_error():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_block_is_freed_only_when_last_holder_drops_it():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.incref(b)
    assert pool.decref(b) is False
    assert not pool.is_free(b)
    assert pool.decref(b) is True
    assert pool.is_free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(b)


def test_shuffled_pool_hands_out_blocks_out_of_order():
    pool = BlockPool(64, shuffle_seed=3)
    assert [pool.allocate() for _ in range(64)] != list(range(64))


def test_zero_blocks_is_a_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
