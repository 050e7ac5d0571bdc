"""The block manager's self-checks (core/kv_cache_manager.py): pools and tables agree. Pure
Python; a mixin of `KVCacheManager`, called by the tests and the stress harness after every
step (`LLMEngine.check_invariants`)."""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, TaggedBlockPool
from pagedserve.core.block_table import BlockTable, cdiv


class KVInvariants:
    """`check_invariants` of `KVCacheManager` (see the module docstring)."""

    def check_invariants(self) -> None:
        """Raise RuntimeError if a pool and its tables disagree (reference counts equal holders,
        a block is free exactly when nobody holds it, tables cover their slots, null entries
        exactly where a sliding-window group gave its blocks back, each group's count of blocks
        in use)."""
        self._check(self.pool, self.tables, "device", self.null,
                    [*self._pinned_blocks(), *self._backup_blocks()])
        if self.cpu_pool is not None:
            self._check(self.cpu_pool, self.cpu_tables, "cpu", self.cpu_null)
        both = set(self.tables) & set(self.cpu_tables)
        if both:
            raise RuntimeError(f"sequences {sorted(both)} are both on the device and swapped")

    def _check(self, pool: BlockPool, tables: dict[int, BlockTable], where: str,
               null: int, pinned=()) -> None:
        # NOTE: work proportional to the blocks held, not to the pool: a CPU swap pool holds
        # ~10^6 blocks for a tiny model, and the tests check after every step. Held blocks are
        # checked one by one; the rest by counts (C-speed list scans): the blocks with a non-zero
        # reference count are exactly the held ones, and the free list is exactly the others.
        holders: dict[int, int] = {}
        column_of: dict[int, int] = {}
        w = self.width
        for seq_id, table in tables.items():
            if len(table.blocks) != cdiv(table.num_tokens, self.block_size) * w:
                raise RuntimeError(f"{where} sequence {seq_id}: {len(table.blocks)} blocks for "
                                   f"{table.num_tokens} slots ({w} per logical block)")
            if not self._plain:
                self._check_nulls(seq_id, table, where, null)
            for i, block in enumerate(table.blocks):
                if block == null:
                    continue
                holders[block] = holders.get(block, 0) + 1
                if column_of.setdefault(block, i % w) != i % w:
                    raise RuntimeError(f"{where} block {block} serves two columns")
        for block, c in pinned:  # (state snapshots the manager holds: core/state_snapshots.py)
            holders[block] = holders.get(block, 0) + 1
            if column_of.setdefault(block, c) != c:
                raise RuntimeError(f"{where} block {block} serves two columns")
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
        if isinstance(pool, TaggedBlockPool):
            counts = [0] * len(pool.used_by_tag)
            for block, c in column_of.items():
                counts[self._col_tag[c]] += 1
                if pool.tags[block] != self._col_tag[c]:
                    raise RuntimeError(f"{where} block {block}: tagged group "
                                       f"{pool.tags[block]}, serves {self._col_tag[c]}")
            if counts != pool.used_by_tag:
                raise RuntimeError(f"{where} blocks in use per group {pool.used_by_tag}, held "
                                   f"{counts}")

    def _check_nulls(self, seq_id: int, table: BlockTable, where: str, null: int) -> None:
        """Null entries only in sliding-window columns, exactly their leading `low` rows."""
        w, blocks = self.width, table.blocks
        rows = len(blocks) // w
        for c in self._full_cols:
            if null in blocks[c::w]:
                raise RuntimeError(f"{where} sequence {seq_id}: a null block in full column {c}")
        for c in self._state_cols:
            col = blocks[c::w]
            if col[:1] == [null] or col[1:] != [null] * (rows - 1):
                raise RuntimeError(f"{where} sequence {seq_id}: state column {c} must hold a "
                                   "block in its first row only")
        for gi, (first, lanes, _) in enumerate(self._sliding):
            low = table.low[gi]
            for c in range(first, first + lanes):
                col = blocks[c::w]
                if low > rows or col[:low] != [null] * low or null in col[low:]:
                    raise RuntimeError(f"{where} sequence {seq_id}: column {c} has null "
                                       f"entries other than its leading {low}")
