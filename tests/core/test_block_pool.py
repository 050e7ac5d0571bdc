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
    held = [pool.allocate() for _ in range(4_000)]  # (no fresh block left: all come back)
    for b in held[:1_500]:  # back to the tail; the head slots stay deleted
        pool.decref(b)
    pool.allocate(), pool.allocate()
    expected = pool.free_blocks()[:600]
    pool._free = counting = _CountingFreeList(pool._free)
    taken = [pool.allocate() for _ in range(600)]
    assert taken == expected
    assert (counting.head_pops, counting.scanned) == (600, 0)
    assert pool.num_free == 898 and len(set(pool.free_blocks())) == 898


class _EagerPool:
    """The pool as first written: every free block an entry of one ordered free list."""

    def __init__(self, num_blocks: int, order: list[int]):
        self.refs = [0] * num_blocks
        self.free = OrderedDict.fromkeys(order)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        self.refs[block] = 1
        return block

    def acquire(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None


@pytest.mark.parametrize("shuffle_seed", [None, 5])
@pytest.mark.parametrize("seed", range(40))
def test_the_lazy_free_list_behaves_as_one_entry_per_free_block(seed, shuffle_seed):
    # Randomized: allocate, acquire (a free block out of turn, fresh or returned, or a held
    # one), incref and decref against the eager free list; the blocks handed out, the free
    # list's order, `num_free` and `is_free` agree after every operation.
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 40)
    pool = BlockPool(n, shuffle_seed=shuffle_seed)
    ref = _EagerPool(n, pool.free_blocks())
    if shuffle_seed is None:
        assert pool.free_blocks() == list(range(n))
    for _ in range(300):
        op = rng.random()
        held = [b for b in range(n) if ref.refs[b]]
        if op < 0.4 and ref.free:
            assert pool.allocate() == ref.allocate()
        elif op < 0.6:
            block = rng.randrange(n)
            pool.acquire(block)
            ref.acquire(block)
        elif op < 0.7 and held:
            block = rng.choice(held)
            pool.incref(block)
            ref.refs[block] += 1
        elif held:
            block = rng.choice(held)
            assert pool.decref(block) == (ref.refs[block] == 1)
            ref.decref(block)
        assert pool.free_blocks() == list(ref.free)
        assert pool.num_free == len(ref.free) and pool.num_used == n - len(ref.free)
        assert [pool.is_free(b) for b in range(n)] == [r == 0 for r in ref.refs]
        assert pool.ref_counts == ref.refs
    if not ref.free:
        with pytest.raises(NoFreeBlocksError):
            pool.allocate()


def test_a_pool_of_millions_of_blocks_holds_no_entry_per_free_block():
    # A tiny model's 4 GiB CPU swap pool in 1 KiB blocks: 4M blocks. Entries for each cost
    # ~0.4 s and ~500 MB of an engine's start-up; the blocks never handed out are a position.
    pool = BlockPool(4 << 20)
    assert pool.num_free == 4 << 20 and len(pool._free) == 0
    first = [pool.allocate() for _ in range(3)]
    assert first == [0, 1, 2] and len(pool._free) == 0
    pool.decref(1)
    assert pool.num_free == (4 << 20) - 2 and list(pool._free) == [1]
