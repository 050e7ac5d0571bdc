"""The pool of physical KV blocks: reference counts and a free list. Pure Python, no torch."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Callable


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is requested from an empty pool (callers check `num_free` first)."""


class BlockPool:
    """Physical KV blocks `0 .. num_blocks - 1`, each with a reference count.

    A block is free exactly when its reference count is 0. Blocks are handed out from the head of
    the free list and returned to its tail, so the free list is in least-recently-freed order:
    a freed block keeps its contents (and prefix-cache entry) until it is handed out again.

    The free list is the blocks never handed out ("fresh", in their initial order) followed by
    the returned ones. NOTE (start-up cost): the fresh blocks are a position in that order, not
    entries: a pool of millions of blocks (a tiny model's KV, or its CPU swap pool of 4 GiB in
    1 KiB blocks) costs nothing per free block, where an entry for each cost ~0.4 s and ~120
    bytes a block at start-up, held for the engine's life.

    NOTE: `shuffle_seed` randomises the initial free-list order. Tests use it to prove that nothing
    depends on blocks being contiguous or ordered; production leaves it None.
    """

    def __init__(
        self,
        num_blocks: int,
        shuffle_seed: int | None = None,
        on_reuse: "Callable[[int], None] | None" = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # The initial order (None: 0 .. num_blocks - 1) and, for a shuffled one, each block's
        # place in it.
        self._order: list[int] | None = None
        self._place: list[int] | None = None
        if shuffle_seed is not None:
            self._order = list(range(num_blocks))
            random.Random(shuffle_seed).shuffle(self._order)
            self._place = [0] * num_blocks
            for i, block in enumerate(self._order):
                self._place[block] = i
        # The fresh blocks: those at places `_next_fresh ..` of the initial order, less the
        # ones `acquire` took out of turn (`_taken_early`, all at places >= `_next_fresh`).
        self._next_fresh = 0
        self._taken_early: set[int] = set()
        # The returned blocks: an insertion-ordered set (O(1) pop from the head, removal by id).
        # NOTE (step cost): an OrderedDict, not a dict: a dict's first key is found by scanning
        # past the slots its deleted keys left at the head of its entry table (until a resize
        # compacts it), so taking blocks from the head of a dict cost O(blocks taken since) each:
        # ~65 us per block after 20k allocations (`tests/core/test_block_pool.py` counts the pops).
        self._free: OrderedDict[int, None] = OrderedDict()
        # Called with a free block about to be handed out again (the prefix cache forgets it).
        self._on_reuse = on_reuse

    def _num_fresh(self) -> int:
        return self.num_blocks - self._next_fresh - len(self._taken_early)

    def _is_fresh(self, block: int) -> bool:
        place = block if self._place is None else self._place[block]
        return place >= self._next_fresh and block not in self._taken_early

    def _take_fresh(self) -> int:
        while True:  # (skips the blocks taken out of turn: each once)
            i = self._next_fresh
            self._next_fresh = i + 1
            block = i if self._order is None else self._order[i]
            if block in self._taken_early:
                self._taken_early.discard(block)
                continue
            return block

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_fresh()

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, tag: int = 0) -> int:
        """Take a free block; its reference count becomes 1. `tag`: the group it serves (see
        `TaggedBlockPool`; ignored here)."""
        if self._num_fresh():
            block = self._take_fresh()
        elif self._free:
            block, _ = self._free.popitem(last=False)
            if self._on_reuse is not None:
                self._on_reuse(block)
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self.ref_counts[block] = 1
        return block

    def acquire(self, block: int, tag: int = 0) -> None:
        """Add a holder to a specific block, taking it off the free list if it was free (a
        prefix-cache hit on a block whose last holder already left). `tag`: as `allocate`."""
        if self.ref_counts[block] == 0:
            if block in self._free:
                del self._free[block]
            else:  # (never handed out yet)
                self._taken_early.add(block)
        self.ref_counts[block] += 1

    def incref(self, block: int) -> None:
        """Add a holder to a block that is in use."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is free; cannot share it")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop a holder; the block returns to the free list at 0. Returns True if it was freed."""
        count = self.ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"block {block} is already free (double free)")
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
            return True
        return False

    def is_free(self, block: int) -> bool:
        """Whether `block` is on the free list (the invariant checks compare this with its
        reference count)."""
        return block in self._free or self._is_fresh(block)

    def free_blocks(self) -> list[int]:
        """The free blocks in free-list order (for tests and invariant checks; O(num_blocks))."""
        rest = range(self._next_fresh, self.num_blocks)
        fresh = [b for b in (rest if self._order is None else (self._order[i] for i in rest))
                 if b not in self._taken_early]
        return fresh + list(self._free)


class TaggedBlockPool(BlockPool):
    """A `BlockPool` that counts its blocks in use per tag (the KV group a block serves, for
    the per-group usage of a model with several groups: `KVCacheManager.group_usage`).

    NOTE: a block's tag is set when it is taken (`allocate`, or `acquire` of a free block) and
    counted until its reference count falls to 0.
    """

    def __init__(self, num_blocks: int, num_tags: int, shuffle_seed: int | None = None,
                 on_reuse: "Callable[[int], None] | None" = None) -> None:
        super().__init__(num_blocks, shuffle_seed=shuffle_seed, on_reuse=on_reuse)
        self.tags = [0] * num_blocks
        self.used_by_tag = [0] * num_tags

    def allocate(self, tag: int = 0) -> int:
        block = super().allocate()
        self.tags[block] = tag
        self.used_by_tag[tag] += 1
        return block

    def acquire(self, block: int, tag: int = 0) -> None:
        if self.ref_counts[block] == 0:
            self.tags[block] = tag
            self.used_by_tag[tag] += 1
        super().acquire(block)

    def decref(self, block: int) -> bool:
        freed = super().decref(block)
        if freed:
            self.used_by_tag[self.tags[block]] -= 1
        return freed
