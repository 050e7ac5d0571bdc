"""Orca-style contiguous KV reservation, for measuring paging against it. Pure Python, no torch.

The paper's baselines reserve, at admission, one contiguous range of KV memory per request that
holds every token it may ever have: `max_model_len` tokens (Orca (Max)), the next power of two of
prompt + output, at most 2x over (Orca (Pow2)), or exactly prompt + output (Orca (Oracle)).

`ContiguousKVCacheManager` is a drop-in sibling of `KVCacheManager` (same interface, same block
tables, same model runner): a reservation is a run of consecutive physical blocks chosen first-fit
over block ids, so a request's reservation is rounded up to whole blocks and external
fragmentation between reservations is real. Only which blocks a sequence gets, and that it gets
all of them at admission, differs from paging.

These allocators exist for the `bench paper` measurement. Paging is the only mode for production
use: no sharing (n > 1, beam search), no prefix caching, no swapping here.
"""

from __future__ import annotations

import bisect

from pagedserve.core.kv_cache_manager import BlockTable, KVCacheManager, cdiv

CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")
# `EngineArgs.kv_allocator` values; "paged" is `KVCacheManager`.
KV_ALLOCATORS = ("paged",) + tuple(f"contiguous-{p}" for p in CONTIGUOUS_POLICIES)


def reservation_tokens(policy: str, total_len: int, max_model_len: int) -> int:
    """Token slots an Orca-style system reserves at admission for a request whose prompt +
    output is `total_len` tokens, under `policy` ("max" | "pow2" | "oracle")."""
    if policy == "max":
        return max_model_len
    if policy == "oracle":
        return total_len
    if policy == "pow2":
        return min(max_model_len, 1 << (total_len - 1).bit_length())
    raise ValueError(f"unknown policy {policy!r}; choose from {CONTIGUOUS_POLICIES}")


class ContiguousAllocator:
    """First-fit ranges in one buffer of `num_slots` units (token slots in the simulation of
    `bench memory`, KV blocks in `ContiguousKVCacheManager`).

    NOTE: `_starts`/`_sizes` are the free ranges sorted by start, never overlapping and never
    adjacent (freeing coalesces with both neighbours), so external fragmentation is real.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._starts = [0]
        self._sizes = [num_slots]

    @property
    def num_free(self) -> int:
        return sum(self._sizes)

    def largest_gap(self) -> int:
        """Size of the largest free range (0 when full)."""
        return max(self._sizes, default=0)

    def free_gaps(self) -> list[int]:
        """Sizes of the free ranges, in address order."""
        return list(self._sizes)

    def allocate(self, size: int) -> int | None:
        """Start of the first free range that holds `size` slots (taken), or None."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        for i, gap in enumerate(self._sizes):
            if gap >= size:
                start = self._starts[i]
                if gap == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Return `[start, start + size)` to the free ranges, merging with its neighbours."""
        i = bisect.bisect_left(self._starts, start)
        prev_end = self._starts[i - 1] + self._sizes[i - 1] if i > 0 else -1
        if prev_end > start or (i < len(self._starts) and start + size > self._starts[i]):
            raise RuntimeError(f"range [{start}, {start + size}) overlaps a free range")
        if prev_end == start:  # merge into the previous range
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]


class ContiguousKVCacheManager(KVCacheManager):
    """`KVCacheManager` whose sequences each reserve one contiguous run of blocks at admission.

    The engine tells the manager each sequence's final length (`expect_length`: prompt +
    max_tokens); the first `allocate_slots` of a sequence reserves
    `cdiv(reservation_tokens(policy, final_len, max_model_len), block_size)` consecutive blocks,
    first fit, and later growth takes the next blocks of that run, so it never needs new memory.

    NOTE: `num_free_blocks` is the largest free run, not the free total: the scheduler admits a
    sequence when `num_new_blocks` (its whole reservation) <= `num_free_blocks`, which is then
    exactly "a contiguous range fits". Running sequences need 0 new blocks, so they are never
    preempted. Every reserved block has reference count 1 (held by its reservation) from
    admission to `free`; the block table holds the leading `cdiv(num_tokens, block_size)` of them.
    """

    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int) -> None:
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {CONTIGUOUS_POLICIES}")
        super().__init__(num_blocks, block_size)
        self.policy = policy
        self.max_model_len = max_model_len
        self.ranges = ContiguousAllocator(num_blocks)
        self.reservations: dict[int, tuple[int, int]] = {}  # seq_id -> (first block, blocks)
        self._final_len: dict[int, int] = {}

    # --- reservations ------------------------------------------------------------------------

    def reservation_blocks(self, final_len: int) -> int:
        """Blocks reserved for a sequence that ends at `final_len` tokens."""
        tokens = reservation_tokens(self.policy, max(1, final_len), self.max_model_len)
        return cdiv(max(tokens, final_len), self.block_size)

    def expect_length(self, seq_id: int, final_len: int) -> None:
        """Record the length `seq_id` will reach (prompt + max_tokens): its reservation size."""
        self._final_len[seq_id] = final_len

    def forget(self, seq_id: int) -> None:
        """Drop what `expect_length` recorded (the request ended); frees its blocks too."""
        self.free(seq_id)
        self._final_len.pop(seq_id, None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the largest free run: the biggest reservation that fits now."""
        return self.ranges.largest_gap()

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """The whole reservation for a sequence without one; 0 for growth inside it."""
        if seq_id in self.reservations:
            _, size = self.reservations[seq_id]
            if cdiv(num_tokens, self.block_size) > size:
                raise RuntimeError(f"sequence {seq_id} outgrew its reservation of {size} blocks")
            return 0
        return self.reservation_blocks(max(num_tokens, self._final_len.get(seq_id, 0)))

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve the sequence's range on first use, then extend its table inside it."""
        if seq_id not in self.reservations:
            size = self.num_new_blocks(seq_id, num_tokens)
            start = self.ranges.allocate(size)
            if start is None:  # the scheduler checks `num_new_blocks` first
                raise RuntimeError(f"no free range of {size} blocks for sequence {seq_id}")
            for block in range(start, start + size):
                self.pool.acquire(block)
            self.reservations[seq_id] = (start, size)
            self.tables[seq_id] = BlockTable()
        start, size = self.reservations[seq_id]
        if cdiv(num_tokens, self.block_size) > size:
            raise RuntimeError(f"sequence {seq_id} outgrew its reservation of {size} blocks")
        table = self.tables[seq_id]
        table.num_tokens = max(table.num_tokens, num_tokens)
        table.blocks = list(range(start, start + cdiv(table.num_tokens, self.block_size)))
        return []

    def fork(self, parent_id: int, child_id: int) -> None:
        raise ValueError("contiguous KV allocators do not share blocks (n > 1, beam search); "
                         "use kv_allocator='paged'")

    def free(self, seq_id: int) -> None:
        """Release the sequence's whole reservation (no-op if it holds none)."""
        self.tables.pop(seq_id, None)
        res = self.reservations.pop(seq_id, None)
        if res is not None:
            start, size = res
            for block in range(start, start + size):
                self.pool.decref(block)
            self.ranges.free(start, size)

    def reserved_tokens(self) -> int:
        """Token slots held by reservations (filled or not)."""
        return sum(size for _, size in self.reservations.values()) * self.block_size

    # --- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError unless live reservations are disjoint, they and the free ranges
        partition the buffer, every reserved block has reference count 1 and every other block
        is free, and each table is the leading part of its own reservation."""
        owner: dict[int, int] = {}
        for seq_id, (start, size) in self.reservations.items():
            for block in range(start, start + size):
                if block in owner:
                    raise RuntimeError(f"block {block} is reserved by sequences {owner[block]} "
                                       f"and {seq_id}")
                owner[block] = seq_id
        gaps = list(zip(self.ranges._starts, self.ranges._sizes))
        free_blocks = {b for s, n in gaps for b in range(s, s + n)}
        if free_blocks & set(owner) or len(free_blocks) + len(owner) != self.num_blocks:
            raise RuntimeError("reservations and free ranges do not partition the buffer")
        for block, count in enumerate(self.pool.ref_counts):
            want = 1 if block in owner else 0
            if count != want or self.pool.is_free(block) != (want == 0):
                raise RuntimeError(f"block {block}: ref count {count}, reserved={want == 1}")
        if set(self.tables) != set(self.reservations):
            raise RuntimeError("block tables and reservations name different sequences")
        for seq_id, table in self.tables.items():
            start, size = self.reservations[seq_id]
            n = cdiv(table.num_tokens, self.block_size)
            if table.blocks != list(range(start, start + n)) or n > size:
                raise RuntimeError(f"sequence {seq_id}: table {table.blocks} is not the head of "
                                   f"its reservation [{start}, {start + size})")
