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
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        # An insertion-ordered set: O(1) pop from the head and removal by id.
        # NOTE (step cost): an OrderedDict, not a dict: a dict's first key is found by scanning
        # past the slots its deleted keys left at the head of its entry table (until a resize
        # compacts it), so taking blocks from the head of a dict cost O(blocks taken since) each:
        # ~65 us per block after 20k allocations (`tests/core/test_block_pool.py` counts the pops).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        # Called with a free block about to be handed out again (the prefix cache forgets it).
        self._on_reuse = on_reuse

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, tag: int = 0) -> int:
        """Take a free block; its reference count becomes 1. `tag`: the group it serves (see
        `TaggedBlockPool`; ignored here)."""
        if not self._free:
            raise NoFreeBlocksError("no free KV blocks")
        block, _ = self._free.popitem(last=False)
        self.ref_counts[block] = 1
        if self._on_reuse is not None:
            self._on_reuse(block)
        return block

    def acquire(self, block: int, tag: int = 0) -> None:
        """Add a holder to a specific block, taking it off the free list if it was free (a
        prefix-cache hit on a block whose last holder already left). `tag`: as `allocate`."""
        if self.ref_counts[block] == 0:
            del self._free[block]
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
        return block in self._free

    def free_blocks(self) -> list[int]:
        """The free blocks in free-list order (for tests and invariant checks)."""
        return list(self._free)


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
