"""Block tables of sequences over a `BlockPool`: the paper's KV block manager. Pure Python.

Each sequence has a block table: the physical blocks holding its logical blocks, in order, and the
number of token slots it has reserved. Slot `p` of a sequence lives in physical block
`table[p // block_size]` at offset `p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.block_pool import BlockPool


def salt_root(salt: str | tuple | None) -> int:
    """The parent hash of a chain's first block: 0 unsalted, else derived from the salt (a
    request's cache_salt, or (cache_salt, LoRA adapter id) for a request with an adapter:
    requests of different adapters never share KV)."""
    return 0 if salt is None else hash(("cache_salt", salt))


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The prefix-cache hash of a full block: chained over its parent's hash and its tokens."""
    return hash((parent, tokens))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockTable:
    """Logical-to-physical block map of one sequence, with the number of reserved token slots."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Chained hashes of the leading full, computed blocks (prefix caching), one per block.
    hashes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KVManagerConfig:
    """What the engine sizes for its KV manager: device and CPU blocks, prefix caching, the
    longest sequence. A `kv_manager_factory` (see `LLMEngine`) builds a manager from it."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = False
    max_model_len: int | None = None


class KVCacheManager:
    """Allocates, grows, forks and frees the block tables of sequences.

    NOTE: a block's reference count always equals the number of block tables that hold it; blocks
    are allocated only when a sequence needs slots beyond its last block (never ahead of time).

    The engine also tells the manager about requests (`check_request`, `on_admit`, `on_finish`);
    paging needs none of it, other managers (the benchmarks' contiguous baselines) plug in there.
    """

    @classmethod
    def from_config(cls, config: KVManagerConfig, shuffle_seed: int | None = None):
        """The paged manager for `config` (the engine's default `kv_manager_factory`)."""
        return cls(config.num_blocks, config.block_size, shuffle_seed=shuffle_seed,
                   num_cpu_blocks=config.num_cpu_blocks,
                   enable_prefix_caching=config.enable_prefix_caching)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        shuffle_seed: int | None = None,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        if not 1 <= block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, shuffle_seed=shuffle_seed, on_reuse=self._forget)
        self.tables: dict[int, BlockTable] = {}
        # Automatic prefix caching: chained hash of a full block -> the block holding it, and
        # per cached block its hash, its parent's hash and its tokens (both checked on every
        # hit: never trust a hash alone).
        self.enable_prefix_caching = enable_prefix_caching
        self._cached: dict[int, int] = {}
        self._block_key: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of those, tokens found cached
        # KV cache events (engine/kv_events.py: a KVEventSink), None: none are collected.
        self.events = None
        # The CPU swap pool: same block shape, its own allocator and tables of swapped sequences.
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.cpu_tables: dict[int, BlockTable] = {}

    # --- queries -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.pool.num_used / self.pool.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        table = self.tables.get(seq_id)
        return table.blocks if table is not None else []

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks a sequence must gain to hold `num_tokens` slots in all (copy-on-write of a shared
        partial last block counts as one)."""
        table = self.tables.get(seq_id)
        if table is None:
            return -(-num_tokens // self.block_size)
        bs = self.block_size
        have = table.num_tokens
        need = -(-num_tokens // bs) - len(table.blocks)
        if need < 0:
            need = 0
        # (_last_block_needs_copy, inlined: once per scheduled sequence)
        if num_tokens > have and have % bs and self.pool.ref_counts[table.blocks[-1]] > 1:
            need += 1
        return need

    def _last_block_needs_copy(self, table: BlockTable, num_tokens: int) -> bool:
        # A write into a partly filled last block that another table also holds must copy it.
        if num_tokens <= table.num_tokens or table.num_tokens % self.block_size == 0:
            return False
        return self.pool.ref_counts[table.blocks[-1]] > 1

    # --- request hooks (called by the engine; no-ops for paging) ------------------------------

    def check_request(self, num_seqs: int, beam_search: bool, prompt_len: int,
                      final_len: int) -> None:
        """Raise ValueError if a request of `num_seqs` sequences (sharing their prompt), ending
        at `final_len` tokens at most, cannot be served. Paging serves any request whose blocks
        fit the cache (checked by the engine)."""

    def on_admit(self, seq_id: int, prompt_len: int, final_len: int) -> None:
        """A sequence was queued: `prompt_len` prompt tokens, at most `final_len` in all."""

    def on_finish(self, seq_id: int) -> None:
        """The sequence's request ended (finished or aborted): drop what `on_admit` recorded and
        any blocks it still holds."""

    # --- mutations ---------------------------------------------------------------------------

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots so that `seq_id` holds `num_tokens` in all; create its table if new.

        Returns copy-on-write pairs `(src_block, dst_block)` whose contents the worker must copy
        before this step's writes. The caller checks `num_new_blocks` against `num_free_blocks`
        first; running out here is a bug, not a user error.
        """
        table = self.tables.get(seq_id)
        if table is None:  # (not setdefault: that would build a table on every call)
            table = self.tables[seq_id] = BlockTable()
        if num_tokens <= table.num_tokens:  # the slots are reserved already
            return []
        copies: list[tuple[int, int]] = []
        blocks = table.blocks
        bs = self.block_size
        # (_last_block_needs_copy, inlined: num_tokens > table.num_tokens holds here)
        if table.num_tokens % bs and self.pool.ref_counts[blocks[-1]] > 1:
            old = blocks[-1]
            new = self.pool.allocate()
            self.pool.decref(old)
            blocks[-1] = new
            copies.append((old, new))
        need = -(-num_tokens // bs) - len(blocks)
        for _ in range(need):
            blocks.append(self.pool.allocate())
        table.num_tokens = num_tokens
        return copies

    def snapshot(self, seq_id: int) -> tuple[int, int, int, int] | None:
        """What `restore` needs to undo this step's `allocate_slots` of `seq_id` (None if it has
        no table): its block count, slot count, last block and hash count (O(1), no copy)."""
        table = self.tables.get(seq_id)
        if table is None:
            return None
        blocks = table.blocks
        return (len(blocks), table.num_tokens, blocks[-1] if blocks else -1, len(table.hashes))

    def restore(self, seq_id: int, snapshot: tuple[int, int, int, int] | None) -> None:
        """Put `seq_id`'s table back as `snapshot` found it, with reference counts to match: the
        blocks gained since (new blocks, a copy-on-write target) are released, the last block it
        held then is held again.

        NOTE: only for undoing this step's `allocate_slots` of a group before the step runs;
        the snapshot's blocks must not have been handed to another sequence in between.
        """
        if snapshot is None:
            table = self.tables.pop(seq_id, None)
            if table is not None:
                for block in reversed(table.blocks):
                    self.pool.decref(block)
            return
        count, num_tokens, last, num_hashes = snapshot
        table = self.tables[seq_id]
        blocks = table.blocks
        if count and blocks[count - 1] != last:  # copy-on-write replaced the last block
            self.pool.acquire(last)
            self.pool.decref(blocks[count - 1])
            blocks[count - 1] = last
        for block in reversed(blocks[count:]):
            self.pool.decref(block)
        del blocks[count:]
        table.num_tokens = num_tokens
        del table.hashes[num_hashes:]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink `seq_id`'s reserved slots to `num_tokens` (speculative decoding: the lookahead
        slots of rejected draft tokens): blocks wholly past them are released; hashes of blocks
        past them are dropped (none are: only computed blocks are hashed). No-op for a sequence
        without a table or with no more slots than that.

        NOTE: the slots kept may hold the rejected drafts' K/V past `num_tokens`: they are
        written again before anything reads them (a sequence reads only its computed slots)."""
        table = self.tables.get(seq_id)
        if table is None or table.num_tokens <= num_tokens:
            return
        keep = cdiv(num_tokens, self.block_size)
        blocks = table.blocks
        for block in reversed(blocks[keep:]):
            self.pool.decref(block)
        del blocks[keep:]
        table.num_tokens = num_tokens
        del table.hashes[num_tokens // self.block_size:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks (shared: reference counts go up)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        parent = self.tables[parent_id]
        for block in parent.blocks:
            self.pool.incref(block)
        self.tables[child_id] = BlockTable(list(parent.blocks), parent.num_tokens,
                                           list(parent.hashes))

    def free(self, seq_id: int) -> None:
        """Release every block of a sequence, on the device and in the swap pool (no-op if it
        holds none)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            # Free from the last block so that a sequence's blocks return to the pool tail in order.
            for block in reversed(table.blocks):
                self.pool.decref(block)
        cpu_table = self.cpu_tables.pop(seq_id, None)
        if cpu_table is not None:
            for block in reversed(cpu_table.blocks):
                self.cpu_pool.decref(block)

    # --- prefix caching ----------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` made of full blocks (cached
        under the same `salt`: a request's `cache_salt` roots its chain of hashes, so requests
        with different salts never share blocks).

        NOTE: at least the last token is always left to compute (its logits are needed), so a
        prompt that is entirely cached gets its last block recomputed into a fresh block; a
        cached block is never written. A hit must match the block's tokens AND its parent's hash
        (the previous block of the chain, or the salt's root): two chains whose hashes collide
        never share KV.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = salt_root(salt)
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block = self._cached.get(h)
            if block is None:
                break
            _, cached_parent, cached_tokens = self._block_key[block]
            if cached_parent != parent or cached_tokens != tokens:
                break
            hits.append(block)
            parent = h
        return hits

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of these blocks sit on the free list (taking them costs free blocks)."""
        return sum(1 for b in blocks if self.pool.ref_counts[b] == 0)

    def use_prefix(self, seq_id: int, blocks: list[int]) -> int:
        """Start `seq_id`'s table with cached blocks; returns the number of tokens they hold."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        for block in blocks:
            self.pool.acquire(block)
        table = BlockTable(list(blocks), len(blocks) * self.block_size,
                           [self._block_key[b][0] for b in blocks])
        self.tables[seq_id] = table
        return table.num_tokens

    def share_blocks(self, seq_id: int, blocks: list[int], salt: str | None = None) -> None:
        """Start `seq_id`'s table with these full, computed blocks that other tables hold or the
        prefix cache keeps (shared: reference counts go up). Their hashes are kept as far as the
        prefix cache knows the chain (under `salt`); `cache_full_blocks` computes the rest."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        for block in blocks:
            self.pool.acquire(block)
        hashes: list[int] = []
        for block in blocks:
            key = self._block_key.get(block)
            if key is None or key[1] != (hashes[-1] if hashes else salt_root(salt)):
                break
            hashes.append(key[0])
        self.tables[seq_id] = BlockTable(list(blocks), len(blocks) * self.block_size, hashes)

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int,
                          salt: str | None = None) -> None:
        """Register the sequence's newly full and computed blocks in the prefix cache (each
        block's hash is computed once), under its `salt` (see `match_prefix`)."""
        table = self.tables.get(seq_id)
        if not self.enable_prefix_caching or table is None:
            return
        bs = self.block_size
        for i in range(len(table.hashes), min(num_computed, table.num_tokens) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = table.hashes[-1] if table.hashes else salt_root(salt)
            h = block_hash(parent, tokens)
            table.hashes.append(h)
            block = table.blocks[i]
            if h not in self._cached and block not in self._block_key:
                self._cached[h] = block
                self._block_key[block] = (h, parent, tokens)
                if self.events is not None:
                    self.events.stored(h, table.hashes[i - 1] if i else None, tokens, salt)

    def _forget(self, block: int) -> None:
        key = self._block_key.pop(block, None)
        if key is not None and self._cached.get(key[0]) == block:
            del self._cached[key[0]]
            if self.events is not None:
                self.events.removed(key[0])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (their contents stay until reused, never matched again).
        Only while no block is in use: False (and nothing changed) otherwise."""
        if self.pool.num_used:
            return False
        self._cached.clear()
        self._block_key.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # --- swapping ----------------------------------------------------------------------------

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free if self.cpu_pool else 0

    def num_distinct_blocks(self, seq_ids: list[int], cpu: bool = False) -> int:
        """Distinct physical blocks held by these sequences (a block shared inside counts once)."""
        tables = self.cpu_tables if cpu else self.tables
        return len({b for s in seq_ids if s in tables for b in tables[s].blocks})

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_distinct_blocks(seq_ids) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move these sequences' tables to the CPU pool; returns (device, cpu) block pairs to copy.

        NOTE: a block shared inside the group is copied once and stays shared on the CPU; the
        group's device references are dropped (a block another holder keeps stays on the device).
        """
        return self._move(seq_ids, self.tables, self.pool, self.cpu_tables, self.cpu_pool)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back to device blocks; returns (cpu, device) pairs to copy."""
        return self._move(seq_ids, self.cpu_tables, self.cpu_pool, self.tables, self.pool)

    @staticmethod
    def _move(seq_ids, src_tables, src_pool, dst_tables, dst_pool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            table = src_tables.pop(seq_id, None)
            if table is None:
                continue
            new_blocks = []
            for block in table.blocks:
                if block in mapping:
                    dst_pool.incref(mapping[block])
                else:
                    mapping[block] = dst_pool.allocate()
                new_blocks.append(mapping[block])
                src_pool.decref(block)
            dst_tables[seq_id] = BlockTable(new_blocks, table.num_tokens, table.hashes)
        return list(mapping.items())

    # --- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError if a pool and its tables disagree (reference counts equal holders,
        a block is free exactly when nobody holds it, tables cover their slots)."""
        self._check(self.pool, self.tables, "device")
        if self.cpu_pool is not None:
            self._check(self.cpu_pool, self.cpu_tables, "cpu")
        both = set(self.tables) & set(self.cpu_tables)
        if both:
            raise RuntimeError(f"sequences {sorted(both)} are both on the device and swapped")

    def _check(self, pool: BlockPool, tables: dict[int, BlockTable], where: str) -> None:
        # NOTE: work proportional to the blocks held, not to the pool: a CPU swap pool holds
        # ~10^6 blocks for a tiny model, and the tests check after every step. Held blocks are
        # checked one by one; the rest by counts (C-speed list scans): the blocks with a non-zero
        # reference count are exactly the held ones, and the free list is exactly the others.
        holders: dict[int, int] = {}
        for seq_id, table in tables.items():
            if len(table.blocks) != cdiv(table.num_tokens, self.block_size):
                raise RuntimeError(f"{where} sequence {seq_id}: {len(table.blocks)} blocks for "
                                   f"{table.num_tokens} slots")
            for block in table.blocks:
                holders[block] = holders.get(block, 0) + 1
        refs = pool.ref_counts
        for block, held in holders.items():
            if refs[block] != held:
                raise RuntimeError(f"{where} block {block}: ref count {refs[block]}, held by {held}")
            if pool.is_free(block):
                raise RuntimeError(f"{where} block {block}: ref count {held} but free=True")
        if len(refs) - refs.count(0) != len(holders):
            block = next(b for b, c in enumerate(refs) if c and b not in holders)
            raise RuntimeError(f"{where} block {block}: ref count {refs[block]}, held by 0")
        if pool.num_free != refs.count(0):
            block = next(b for b, c in enumerate(refs) if c == 0 and not pool.is_free(b))
            raise RuntimeError(f"{where} block {block}: ref count 0 but free=False")
