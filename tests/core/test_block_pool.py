"""The block pool: reference counts and the free list."""

from collections import OrderedDict

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


class _CountingFreeList(OrderedDict):
    """The pool's free list, counting how it is used: head pops, and entries yielded by any
    iteration (a scan for the head)."""

    def __init__(self, entries):
        super().__init__(entries)
        self.head_pops = self.scanned = 0

    def popitem(self, last=True):
        self.head_pops += not last
        return super().popitem(last)

    def __iter__(self):
        for key in super().__iter__():
            self.scanned += 1
            yield key


def test_taking_a_block_touches_one_free_list_entry_however_blocks_churned():
    # Regression (issue 25): the free list was a dict, whose first key is found by scanning
    # past the slots its deleted keys left at the head (until a resize): after 120k blocks
    # handed out, taking one more cost 40-70x what it costs in a fresh pool. An OrderedDict
    # pops its head through its linked list, whatever was deleted before. Counted, not timed:
    # the free list is an OrderedDict, and taking n blocks after churn is n head pops and no
    # scan, in least-recently-freed order.
    pool = BlockPool(4_000)
    assert type(pool._free) is OrderedDict  # (a plain dict's head is a scan: see above)
    held = [pool.allocate() for _ in range(3_000)]
    for b in held[:500]:  # back to the tail; the head slots stay deleted
        pool.decref(b)
    expected = pool.free_blocks()[:600]
    pool._free = counting = _CountingFreeList(pool._free)
    taken = [pool.allocate() for _ in range(600)]
    assert taken == expected
    assert (counting.head_pops, counting.scanned) == (600, 0)
    assert pool.num_free == 900 and len(set(pool.free_blocks())) == 900
