"""Block tables of sequences over a `BlockPool`: the paper's KV block manager. Pure Python.

Each sequence has a block table: the physical blocks holding its logical blocks, in order, and the
number of token slots it has reserved. Slot `p` of a sequence lives in physical block
`table[p // block_size]` at offset `p % block_size`.

A model whose layers keep different things (sliding-window and full attention, core/kv_spec.py)
has several *groups* of layers over the same pool of equal-size blocks. Its table row holds, per
logical block, one block per column (`width` of them: each group's lanes), flat:
logical block `i` of column `c` is `blocks[i * width + c]`, so a model of one group has the plain
table above. A sliding-window group gives back a block once no query of the sequence can reach
it (`free_out_of_window`, after each step): its entry becomes the *null block* (`null`, the
pool's size: the worker's always-zero block), and such entries are never read. A recurrent
state group (`RecurrentStateSpec`: Gated DeltaNet, Mamba) holds a block only in the first
logical block of its columns, for the sequence's life (rewritten in place every step: a shared
one is copied before the step writes it); its entries in later logical blocks are null. Its
state is not shared between requests through the tables; prefix caching keeps snapshots of it
at block boundaries instead (core/state_snapshots.py), and a speculative row keeps the state it
started from until its drafts are verified (core/state_rollback.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagedserve.core.block_pool import BlockPool, TaggedBlockPool
from pagedserve.core.block_table import BlockTable, block_hash, cdiv, salt_root  # noqa: F401
from pagedserve.core.kv_invariants import KVInvariants
from pagedserve.core.kv_spec import KVLayout
from pagedserve.core.prefix_cache import PrefixCaching
from pagedserve.core.state_rollback import StateRollback
from pagedserve.core.state_snapshots import StateSnapshots


@dataclass(frozen=True)
class KVManagerConfig:
    """What the engine sizes for its KV manager: device and CPU blocks, prefix caching, the
    longest sequence, and how the model's layer groups share the blocks (`layout`, None: one
    group of full attention). A `kv_manager_factory` (see `LLMEngine`) builds a manager from
    it."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = False
    max_model_len: int | None = None
    layout: KVLayout | None = None


class KVCacheManager(PrefixCaching, StateSnapshots, StateRollback, KVInvariants):
    """Allocates, grows, forks and frees the block tables of sequences.

    NOTE: a block's reference count always equals the number of block tables that hold it; blocks
    are allocated only when a sequence needs slots beyond its last block (never ahead of time).
    With several layer groups every rule holds per block of every column; a logical block is
    allocated `width` blocks at once, and a sliding-window group's blocks go back as its window
    moves on.

    The engine also tells the manager about requests (`check_request`, `on_admit`, `on_finish`);
    paging needs none of it, other managers (the benchmarks' contiguous baselines) plug in there.
    """

    @classmethod
    def from_config(cls, config: KVManagerConfig, shuffle_seed: int | None = None):
        """The paged manager for `config` (the engine's default `kv_manager_factory`)."""
        return cls(config.num_blocks, config.block_size, shuffle_seed=shuffle_seed,
                   num_cpu_blocks=config.num_cpu_blocks,
                   enable_prefix_caching=config.enable_prefix_caching, layout=config.layout)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        shuffle_seed: int | None = None,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        layout: KVLayout | None = None,
    ) -> None:
        if not 1 <= block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.layout = layout
        groups = layout.groups if layout is not None else ()
        # Columns of a table row; per column, its group (the tag of its blocks in the pool).
        self.width = layout.width if layout is not None else 1
        self._col_tag = [i for i, g in enumerate(groups) for _ in range(g.lanes)] or [0]
        # (first column, lanes, window) of each sliding-window group
        self._sliding = [(g.first_column, g.lanes, g.window) for g in groups
                         if g.window is not None]
        # columns of recurrent state groups: a block in the first logical block only
        self._state_cols = [c for g in groups if g.spec.rule() == ("state",) for c in g.columns]
        # the columns a later logical block allocates (all but the state columns)
        state = set(self._state_cols)
        self._live_cols = [c for c in range(self.width) if c not in state]
        self._full_cols = [c for g in groups if g.window is None and g.spec.rule() != ("state",)
                           for c in g.columns] if groups else [0]
        # NOTE: the fast paths (one column, nothing given back) are today's code, branch-free.
        self._plain = self.width == 1 and not self._sliding and not self._state_cols
        if len(groups) > 1:
            self.pool = TaggedBlockPool(num_blocks, len(groups), shuffle_seed=shuffle_seed,
                                        on_reuse=self._forget)
        else:
            self.pool = BlockPool(num_blocks, shuffle_seed=shuffle_seed, on_reuse=self._forget)
        # The null entry of a table (a block given back by a sliding-window group): the pool's
        # size, which is the worker's never-written, always-zero block.
        self.null = num_blocks
        self.tables: dict[int, BlockTable] = {}
        # Automatic prefix caching: chained hash of a full block (and its column, with several)
        # -> the block holding it, and per cached block its hash, its parent's hash, its tokens
        # and column (parent and tokens checked on every hit: never trust a hash alone).
        self.enable_prefix_caching = enable_prefix_caching
        self._cached: dict = {}
        self._block_key: dict[int, tuple[int, int, tuple[int, ...], int]] = {}
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of those, tokens found cached
        # KV cache events (engine/kv_events.py: a KVEventSink), None: none are collected.
        self.events = None
        # The column whose blocks speak for a logical block in KV events: the first that is
        # not a recurrent state (a pure state model has none: no events).
        self._event_col = self._live_cols[0] if self._live_cols else -1
        self._init_snapshots()
        self._init_rollback()
        # The CPU swap pool: same block shape, its own allocator and tables of swapped sequences.
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.cpu_null = num_cpu_blocks
        self.cpu_tables: dict[int, BlockTable] = {}

    # --- queries -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def has_sliding_window(self) -> bool:
        """Whether some group gives its blocks back as its window moves (`free_out_of_window`)."""
        return bool(self._sliding)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.pool.num_used / self.pool.num_blocks

    def group_usage(self) -> list[tuple[str, int]]:
        """(group name, blocks in use) of each layer group, in the layout's order."""
        if self.layout is None:
            return [("full", self.pool.num_used)]
        groups = self.layout.groups
        if len(groups) == 1:
            return [(groups[0].name, self.pool.num_used)]
        return [(g.name, n) for g, n in zip(groups, self.pool.used_by_tag)]

    @property
    def has_groups(self) -> bool:
        """Whether the model's KV has more than one group, or one that gives blocks back (the
        per-group figures then say more than `usage`)."""
        return not self._plain

    def group_stats(self) -> list[tuple[str, int, int, int]]:
        """Per layer group: (name, blocks in use, token slots those blocks hold, slots holding
        KV a query may still read: every computed token of a full group, the last `window` of
        a sliding-window group). Held minus live is the group's waste: the empty slots of last
        blocks, and a sliding group's slots behind its window in a block it still holds.

        NOTE: O(sequences x groups); a block shared by several sequences counts its live slots
        once per holder (live can then exceed held: no waste)."""
        bs = self.block_size
        if self.layout is None:
            groups = [("full", None, 1)]
        else:
            groups = [(g.name, -1 if g.spec.rule() == ("state",) else g.window, g.lanes)
                      for g in self.layout.groups]
        used = (self.pool.used_by_tag if isinstance(self.pool, TaggedBlockPool)
                else [self.pool.num_used])
        lengths = [t.num_tokens for t in self.tables.values()]
        out = []
        for (name, window, lanes), n in zip(groups, used):
            if window == -1:  # a recurrent state: all of its one block per sequence
                live = lanes * bs * sum(1 for x in lengths if x)
            else:
                live = lanes * (sum(lengths) if window is None
                                else sum(min(x, window) for x in lengths))
            out.append((name, n, n * bs, live))
        return out

    def block_table(self, seq_id: int) -> list[int]:
        table = self.tables.get(seq_id)
        return table.blocks if table is not None else []

    def blocks_for(self, num_tokens: int, chunk: int) -> int:
        """Blocks one sequence of `num_tokens` holds at its peak when a step computes at most
        `chunk` of its tokens (a sliding-window group holds its window and a chunk)."""
        if self.layout is None:
            return cdiv(num_tokens, self.block_size)
        return self.layout.blocks_per_request(num_tokens, self.block_size, chunk)

    def num_new_blocks(self, seq_id: int, num_tokens: int, keep_state: bool = False) -> int:
        """Blocks a sequence must gain to hold `num_tokens` slots in all (copy-on-write of a shared
        partial last block counts as one per column; `keep_state`: a speculative row, whose state
        blocks are all copied, see core/state_rollback.py)."""
        table = self.tables.get(seq_id)
        bs = self.block_size
        if table is None:
            return self._row_blocks(0, -(-num_tokens // bs))
        have = table.num_tokens
        if self._plain:
            need = -(-num_tokens // bs) - len(table.blocks)
            if need < 0:
                need = 0
            # (_last_block_needs_copy, inlined: once per scheduled sequence)
            if num_tokens > have and have % bs and self.pool.ref_counts[table.blocks[-1]] > 1:
                need += 1
            return need
        w = self.width
        blocks = table.blocks
        rows = len(blocks) // w
        need = self._row_blocks(rows, -(-num_tokens // bs)) if num_tokens > rows * bs else 0
        if num_tokens > have:
            refs, null = self.pool.ref_counts, self.null
            if have % bs:
                for b in blocks[-w:]:
                    if b != null and refs[b] > 1:
                        need += 1
            for c in self._state_cols if rows else ():  # (a state is rewritten every step)
                shared = refs[blocks[c]] > 1
                # (a shared one in a partial first row was counted with the last row's)
                if (shared or keep_state) and not (shared and have % bs and rows == 1):
                    need += 1
        return need

    def _row_blocks(self, rows: int, upto: int) -> int:
        """Pool blocks that logical blocks `rows .. upto - 1` of a sequence take: every column
        in its first logical block, the state columns in no later one."""
        if upto <= rows:
            return 0
        return (upto - rows) * (self.width - len(self._state_cols)) \
            + (len(self._state_cols) if rows == 0 else 0)

    def hit_tokens(self, blocks: list[int]) -> int:
        """Tokens held by a prefix of logical blocks (`match_prefix`, `shareable_prefix`)."""
        return len(blocks) // self.width * self.block_size

    def num_blocks_to_map(self, num_tokens: int, shared: list[int]) -> int:
        """Free blocks a sequence without a table takes to hold `num_tokens` slots when it
        starts with `shared` (computed blocks others hold or the prefix cache keeps): its new
        blocks, and the shared ones that sit on the free list."""
        w = self.width
        # (a hit of a state model: its first row's live state blocks are new, `use_prefix`)
        live = len(self._state_cols) if shared and self._state_cols else 0
        return self._row_blocks(len(shared) // w, cdiv(num_tokens, self.block_size)) \
            + self.num_free_among(shared) + live

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

    def _new_table(self) -> BlockTable:
        return BlockTable(low=[0] * len(self._sliding) if self._sliding else None)

    def allocate_slots(self, seq_id: int, num_tokens: int,
                       keep_state: bool = False) -> list[tuple[int, int]]:
        """Reserve slots so that `seq_id` holds `num_tokens` in all; create its table if new.
        `keep_state`: a speculative row (drafts past the sequence's tokens); a state model's
        sequence then keeps the state it starts from (`StateRollback`, settled after the step).

        Returns copy-on-write pairs `(src_block, dst_block)` whose contents the worker must copy
        before this step's writes. The caller checks `num_new_blocks` against `num_free_blocks`
        first; running out here is a bug, not a user error.
        """
        table = self.tables.get(seq_id)
        if table is None:  # (not setdefault: that would build a table on every call)
            table = self.tables[seq_id] = self._new_table()
        if num_tokens <= table.num_tokens:  # the slots are reserved already
            return []
        copies: list[tuple[int, int]] = []
        blocks = table.blocks
        bs = self.block_size
        pool = self.pool
        if self._plain:
            # (_last_block_needs_copy, inlined: num_tokens > table.num_tokens holds here)
            if table.num_tokens % bs and pool.ref_counts[blocks[-1]] > 1:
                old = blocks[-1]
                new = pool.allocate()
                pool.decref(old)
                blocks[-1] = new
                copies.append((old, new))
                table.changed_from(len(blocks) - 1)
            need = -(-num_tokens // bs) - len(blocks)
            for _ in range(need):
                blocks.append(pool.allocate())
            table.num_tokens = num_tokens
            return copies
        w, tags, null = self.width, self._col_tag, self.null
        refs = pool.ref_counts
        if keep_state and blocks and self._state_cols:
            # (a speculative row of a state model's sequence: before copy-on-write, so the fresh
            # copies are unshared and the backups keep the references)
            self._backup_states(seq_id, table, copies)
        # the last row's shared blocks (written from a partial block on), and the state blocks
        # (rewritten every step), are copied before this step writes them
        # NOTE (step cost): index lists, no membership tests: a state takes ~200 columns
        last = range(len(blocks) - w, len(blocks)) if table.num_tokens % bs else range(0)
        cow = itertools.chain(last, self._state_cols if len(blocks) > len(last) else ())
        for i in cow:
            old = blocks[i]
            if old != null and refs[old] > 1:
                new = pool.allocate(tags[i % w])
                pool.decref(old)
                blocks[i] = new
                copies.append((old, new))
                table.changed_from(i)
        need = -(-num_tokens // bs) - len(blocks) // w
        for _ in range(need):
            if blocks and self._state_cols:  # (state columns: null past the first row)
                row = [null] * w
                for c in self._live_cols:
                    row[c] = pool.allocate(tags[c])
                blocks.extend(row)
            else:
                for c in range(w):
                    blocks.append(pool.allocate(tags[c]))
        table.num_tokens = num_tokens
        return copies

    def free_out_of_window(self, seq_id: int, num_computed: int) -> None:
        """Give back the blocks of `seq_id`'s sliding-window groups that no query can reach
        again: the next query is at position `num_computed` and reads keys from
        `num_computed - window + 1` on, so the logical blocks wholly before that go (their
        entries become null). No-op without sliding-window groups or a table.

        NOTE: called after a step, once its blocks were offered to the prefix cache; a step
        computing a chunk of `n` tokens then holds at most the window before it and the chunk."""
        table = self.tables.get(seq_id)
        if table is None or not self._sliding:
            return
        bs, w, null, pool = self.block_size, self.width, self.null, self.pool
        blocks, low = table.blocks, table.low
        rows = len(blocks) // w
        for gi, (first, lanes, window) in enumerate(self._sliding):
            lo = min((num_computed - window + 1) // bs, rows)
            start = low[gi]
            if lo <= start:
                continue
            for i in range(start, lo):
                base = i * w + first
                for c in range(base, base + lanes):
                    b = blocks[c]
                    if b != null:
                        pool.decref(b)
                        blocks[c] = null
                        table.changed_from(c)
            low[gi] = lo

    def snapshot(self, seq_id: int) -> tuple | None:
        """What `restore` needs to undo this step's `allocate_slots` of `seq_id` (None if it has
        no table): its block count, slot count, last block (its last row with several columns)
        and hash count (O(1), no copy)."""
        table = self.tables.get(seq_id)
        if table is None:
            return None
        blocks = table.blocks
        if self._plain:
            return (len(blocks), table.num_tokens, blocks[-1] if blocks else -1,
                    len(table.hashes))
        return (len(blocks), table.num_tokens, tuple(blocks[-self.width:]), len(table.hashes),
                tuple(blocks[c] for c in self._state_cols if c < len(blocks)))

    def restore(self, seq_id: int, snapshot: tuple | None) -> None:
        """Put `seq_id`'s table back as `snapshot` found it, with reference counts to match: the
        blocks gained since (new blocks, a copy-on-write target) are released, the last block it
        held then is held again.

        NOTE: only for undoing this step's `allocate_slots` of a group before the step runs;
        the snapshot's blocks must not have been handed to another sequence in between. It
        moves no mark of the workers' copy (`BlockTable.synced`): the entries it puts back were
        marked when they were replaced, and the ones it removes were appended past `sent_len`.
        """
        pool = self.pool
        if snapshot is None:
            table = self.tables.pop(seq_id, None)
            if table is not None:
                self._release(table.blocks, pool, self.null)
            self._drop_hit(seq_id)
            self._drop_backup(seq_id)
            return
        count, num_tokens, last, num_hashes = snapshot[:4]
        table = self.tables[seq_id]
        blocks = table.blocks
        if self._state_backups:
            self._undo_backup(seq_id, blocks)
        # state blocks of the first row that copy-on-write replaced (its last row's are below)
        for c, old in zip(self._state_cols, snapshot[4] if len(snapshot) > 4 else ()):
            if count > self.width and blocks[c] != old:
                pool.acquire(old, self._col_tag[c])
                pool.decref(blocks[c])
                blocks[c] = old
        if self._plain:
            if count and blocks[count - 1] != last:  # copy-on-write replaced the last block
                pool.acquire(last)
                pool.decref(blocks[count - 1])
                blocks[count - 1] = last
        elif count:
            base = count - len(last)
            for c, old in enumerate(last):
                if blocks[base + c] != old:  # copy-on-write replaced it
                    pool.acquire(old, self._col_tag[c])
                    pool.decref(blocks[base + c])
                    blocks[base + c] = old
        null = self.null
        for block in reversed(blocks[count:]):  # (new blocks: null only in state columns)
            if block != null:
                pool.decref(block)
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
        keep = cdiv(num_tokens, self.block_size) * self.width
        blocks = table.blocks
        self._release(blocks[keep:], self.pool, self.null)
        del blocks[keep:]
        table.changed_from(keep)
        table.num_tokens = num_tokens
        del table.hashes[num_tokens // self.block_size:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks (shared: reference counts go up)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        parent = self.tables[parent_id]
        incref, null = self.pool.incref, self.null
        for block in parent.blocks:
            if block != null:
                incref(block)
        self.tables[child_id] = BlockTable(list(parent.blocks), parent.num_tokens,
                                           list(parent.hashes),
                                           None if parent.low is None else list(parent.low))

    def free(self, seq_id: int) -> None:
        """Release every block of a sequence, on the device and in the swap pool (no-op if it
        holds none)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            self._release(table.blocks, self.pool, self.null)
        if self._hit_copies:
            self._drop_hit(seq_id)
        if self._state_backups:
            self._drop_backup(seq_id)
        cpu_table = self.cpu_tables.pop(seq_id, None)
        if cpu_table is not None:
            self._release(cpu_table.blocks, self.cpu_pool, self.cpu_null)

    @staticmethod
    def _release(blocks: list[int], pool: BlockPool, null: int) -> None:
        # Free from the last block so that a sequence's blocks return to the pool tail in order.
        decref = pool.decref
        for block in reversed(blocks):
            if block != null:
                decref(block)

    # --- swapping ----------------------------------------------------------------------------

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free if self.cpu_pool else 0

    def num_distinct_blocks(self, seq_ids: list[int], cpu: bool = False) -> int:
        """Distinct physical blocks held by these sequences (a block shared inside counts once)."""
        tables = self.cpu_tables if cpu else self.tables
        held = {b for s in seq_ids if s in tables for b in tables[s].blocks}
        held.discard(self.cpu_null if cpu else self.null)
        return len(held)

    def num_swap_in_growth(self, seq_id: int, num_tokens: int) -> int:
        """Device blocks a swapped sequence needs beyond its CPU blocks to hold `num_tokens`
        slots, copy-on-write of its last row included (an upper bound)."""
        w = self.width
        rows = len(self.cpu_tables[seq_id].blocks) // w
        return (max(0, cdiv(num_tokens, self.block_size) - rows) + 1) * w

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        # NOTE: never without a CPU pool, not even sequences holding no block (an unparked beam's
        # empty table): their CPU tables had no pool to give back to (a crash on free).
        return self.cpu_pool is not None and \
            self.num_distinct_blocks(seq_ids) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move these sequences' tables to the CPU pool; returns (device, cpu) block pairs to copy.

        NOTE: a block shared inside the group is copied once and stays shared on the CPU; the
        group's device references are dropped (a block another holder keeps stays on the device).
        """
        return self._move(seq_ids, self.tables, self.pool, self.null, self.cpu_tables,
                          self.cpu_pool, self.cpu_null)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back to device blocks; returns (cpu, device) pairs to copy."""
        return self._move(seq_ids, self.cpu_tables, self.cpu_pool, self.cpu_null, self.tables,
                          self.pool, self.null)

    def _move(self, seq_ids, src_tables, src_pool, src_null, dst_tables, dst_pool,
              dst_null) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        w, tags = self.width, self._col_tag
        # a sequence started from a state snapshot in this step, swapped out before its copy
        # ran: its live state goes out from the snapshot (`StateSnapshots.swap_source`)
        source = self._swap_sources(seq_ids) if self._hit_copies and src_pool is self.pool \
            else {}
        for seq_id in seq_ids:
            if seq_id in self._state_backups:  # (never: a victim is unscheduled first)
                raise RuntimeError(f"sequence {seq_id} swapped with its speculative row pending")
            table = src_tables.pop(seq_id, None)
            if table is None:
                continue
            new_blocks = []
            for i, block in enumerate(table.blocks):
                if block == src_null:  # (given back by a sliding-window group)
                    new_blocks.append(dst_null)
                    continue
                if block in mapping:
                    dst_pool.incref(mapping[block])
                else:
                    mapping[block] = dst_pool.allocate(tags[i % w])
                new_blocks.append(mapping[block])
                src_pool.decref(block)
            dst_tables[seq_id] = BlockTable(new_blocks, table.num_tokens, table.hashes,
                                            table.low)
        return [(source.get(src, src), dst) for src, dst in mapping.items()]
