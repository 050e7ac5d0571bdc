"""Orca-style contiguous KV reservation: the baselines `bench paper` and `bench memory` measure
paging against. Pure Python, no torch; not part of the serving runtime.

The paper's baselines reserve, at admission, one contiguous range of KV memory per request that
holds every token it may ever have: `max_model_len` tokens (Orca (Max)), the prompt plus the next
power of two of the output length, so the output part is at most 2x over (Orca (Pow2)), or exactly
prompt + output (Orca (Oracle)).

`ContiguousKVCacheManager` is a drop-in sibling of `KVCacheManager` (same interface, same block
tables, same model runner), plugged into the engine by `kv_manager_factory(allocator)`: a
reservation is a run of consecutive physical blocks chosen first-fit over block ids, so a
request's reservation is rounded up to whole blocks and external fragmentation between
reservations is real. Only which blocks a sequence gets, and that it gets all of them at
admission, differs from paging. No sharing (n > 1, beam search), no prefix caching, no swapping.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

from pagedserve.core.kv_cache_manager import BlockTable, KVCacheManager, KVManagerConfig, cdiv

logger = logging.getLogger(__name__)

CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")
# The allocators `bench paper` compares; "paged" is `KVCacheManager`.
KV_ALLOCATORS = ("paged",) + tuple(f"contiguous-{p}" for p in CONTIGUOUS_POLICIES)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def reservation_tokens(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Token slots an Orca-style system reserves at admission for a request of `prompt_len`
    prompt tokens and up to `output_len` output tokens, under `policy`: "max" (`max_model_len`),
    "pow2" (the prompt plus the next power of two of the output length, as in the paper) or
    "oracle" (prompt + output). Never more than `max_model_len`."""
    if policy == "max":
        return max_model_len
    if policy == "oracle":
        return min(max_model_len, prompt_len + output_len)
    if policy == "pow2":
        return min(max_model_len, prompt_len + next_pow2(output_len))
    raise ValueError(f"unknown policy {policy!r}; choose from {CONTIGUOUS_POLICIES}")


def kv_manager_factory(allocator: str) -> Callable[[KVManagerConfig], KVCacheManager] | None:
    """The engine's `kv_manager_factory` for an entry of `KV_ALLOCATORS` (None: paging)."""
    if allocator not in KV_ALLOCATORS:
        raise ValueError(f"allocator must be one of {KV_ALLOCATORS}, got {allocator!r}")
    if allocator == "paged":
        return None
    policy = allocator.removeprefix("contiguous-")

    def build(config: KVManagerConfig) -> ContiguousKVCacheManager:
        if config.max_model_len is None:
            raise ValueError("a contiguous KV manager needs max_model_len")
        # NOTE: prefix caching and swapping are off (not an error: both are on by default);
        # running requests never need memory, so they are never preempted.
        logger.info("KV allocator %s (a benchmark baseline): prefix caching and swapping are "
                    "off", allocator)
        kv = ContiguousKVCacheManager(config.num_blocks, config.block_size, policy,
                                      config.max_model_len)
        smallest = kv.reservation_blocks(1, 1)
        if smallest > config.num_blocks:
            raise ValueError(f"{allocator} reserves {smallest} blocks per request; the cache has "
                             f"{config.num_blocks} (raise the KV budget or lower max_model_len)")
        return kv

    return build


class ContiguousAllocator:
    """First-fit ranges in one buffer of `num_slots` units (the KV blocks of a
    `ContiguousKVCacheManager`).

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

    The engine tells the manager each sequence's prompt and final length (`on_admit`: prompt +
    max_tokens); the first `allocate_slots` of a sequence reserves `reservation_blocks` consecutive
    blocks, first fit, and later growth takes the next blocks of that run, so it never needs new
    memory.

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
        self._lengths: dict[int, tuple[int, int]] = {}  # seq_id -> (prompt, final length)

    # --- reservations ------------------------------------------------------------------------

    def reservation_blocks(self, prompt_len: int, final_len: int) -> int:
        """Blocks reserved for a sequence of `prompt_len` prompt tokens ending at `final_len`."""
        tokens = reservation_tokens(self.policy, prompt_len, final_len - prompt_len,
                                    self.max_model_len)
        return cdiv(max(tokens, final_len, 1), self.block_size)

    def check_request(self, num_seqs: int, beam_search: bool, prompt_len: int,
                      final_len: int) -> None:
        """ValueError for sharing (n, best_of > 1, beam search) and for a reservation larger
        than the cache."""
        if num_seqs > 1 or beam_search:
            raise ValueError(f"the contiguous-{self.policy} KV baseline does not share blocks: "
                             "n, best_of > 1 and beam search need paging")
        need = self.reservation_blocks(prompt_len, final_len)
        if need > self.num_blocks:
            raise ValueError(f"the contiguous-{self.policy} KV baseline reserves {need} KV blocks "
                             f"for this request; the cache has {self.num_blocks}")

    def on_admit(self, seq_id: int, prompt_len: int, final_len: int) -> None:
        """Record the sequence's lengths: its reservation size."""
        self._lengths[seq_id] = (prompt_len, final_len)

    def on_finish(self, seq_id: int) -> None:
        """Drop what `on_admit` recorded (the request ended); frees its blocks too."""
        self.free(seq_id)
        self._lengths.pop(seq_id, None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the largest free run: the biggest reservation that fits now."""
        return self.ranges.largest_gap()

    def num_new_blocks(self, seq_id: int, num_tokens: int, keep_state: bool = False) -> int:
        """The whole reservation for a sequence without one; 0 for growth inside it.
        (`keep_state`: a speculative row's; a baseline of one group holds no recurrent state.)"""
        if seq_id in self.reservations:
            _, size = self.reservations[seq_id]
            if cdiv(num_tokens, self.block_size) > size:
                raise RuntimeError(f"sequence {seq_id} outgrew its reservation of {size} blocks")
            return 0
        prompt_len, final_len = self._lengths.get(seq_id, (num_tokens, num_tokens))
        return self.reservation_blocks(prompt_len, max(num_tokens, final_len))

    def allocate_slots(self, seq_id: int, num_tokens: int,
                       keep_state: bool = False) -> list[tuple[int, int]]:
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
                         "sharing needs paging")

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
