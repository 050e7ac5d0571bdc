"""Prefix caching for models with a recurrent state (Gated DeltaNet, Mamba): state snapshots at
block boundaries. Pure Python; a mixin of `KVCacheManager` (after `PrefixCaching`).

A recurrent layer's state after `n` tokens is no function of one block's tokens, but it is a
function of the first `n` tokens. So a *snapshot* of a sequence's state taken when it has
computed exactly `(i + 1) * block_size` tokens is cached under the chained hash of its logical
block `i`, in the state columns (one block per state column, tagged with the state group), and
a later prompt whose first `i + 1` blocks hit (every attention column's blocks as usual) starts
from it: its own live state block (the first logical block's, as always) is a copy of the
snapshot, and it computes from token `(i + 1) * block_size` on.

When snapshots are taken (`take_snapshots`, once a step is scheduled, from the blocks left free
after it: a snapshot never costs a scheduled row its blocks, and never preempts anybody): every
scheduled row that starts at a block boundary past the first block, i.e. every `block_size`
decode tokens, at the end of every prompt chunk that ends on a boundary, and at the prompt's
last full block, where the scheduler ends a chunk on purpose (`step_budget.plan_tokens`'s
`align`). The copy runs
with the step's copy-on-write copies, before the step writes the live state.

NOTE: a snapshot is held by no table. It is pinned (a reference held by the manager) until the
step that copies it has run (`end_step`), then sits on the free list as any cached block: the
pool hands it out again when it runs short (evicting it from the cache), so snapshots never
take capacity from running sequences. A hit's snapshot is pinned from `use_prefix` until the
step that copies it into the sequence's live state has run.
"""

from __future__ import annotations

from pagedserve.core.block_table import block_hash


class StateSnapshots:
    """The recurrent-state half of prefix caching (see the module docstring)."""

    def _init_snapshots(self) -> None:
        # Blocks (and their columns) pinned until the step now scheduled has run.
        self._pinned: list[tuple[int, int]] = []
        # What the last `match_prefix` found of the prompt's attention blocks (tokens), hit or
        # not: where a state snapshot would let the next such prompt hit further.
        self.junction_tokens = 0
        # Per sequence started from a snapshot in the step being scheduled: its (snapshot ->
        # live) copies and pinned snapshot blocks, until the step's copies are taken
        # (`take_hit_copies`).
        self._hit_copies: dict[int, list[tuple[int, int, int]]] = {}

    @property
    def snapshots_state(self) -> bool:
        """Whether prefix caching keeps recurrent-state snapshots (a state model with prefix
        caching on)."""
        return bool(self._state_cols) and self.enable_prefix_caching

    def take_snapshots(self, rows, copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Snapshot the state of the scheduled `rows` ((seq_id, token_ids, start, salt) each)
        that start on a block boundary past the first block and whose last block no snapshot
        holds yet, while free blocks last. Returns the copies to append to the step's `copies`
        (read to find a live block that copy-on-write replaced this step: its content is the
        replaced block's until the copies run)."""
        if not self.snapshots_state:
            return []
        bs, pool = self.block_size, self.pool
        cols, tags = self._state_cols, self._col_tag
        out: list[tuple[int, int]] = []
        replaced = None
        for seq_id, token_ids, start, salt in rows:
            i = start // bs - 1
            if start % bs or i < 1:
                continue
            table = self.tables.get(seq_id)
            if table is None or len(table.hashes) <= i or table.hashes[i] is None:
                continue
            h = table.hashes[i]
            if self._key(h, cols[0]) in self._cached:
                continue  # (this state is cached: the hit this row started from, or a twin's)
            if pool.num_free < len(cols):
                break
            tokens = tuple(token_ids[i * bs : start])
            parent = table.hashes[i - 1] if table.hashes[i - 1] is not None \
                else self._chain_hash(token_ids, i, salt)
            if block_hash(parent, tokens) != h:
                continue  # (never: the table's hashes are the chain of its tokens)
            if replaced is None:
                replaced = {dst: src for src, dst in copies}
            for c in cols:
                live = table.blocks[c]
                block = pool.allocate(tags[c])
                out.append((replaced.get(live, live), block))
                self._cached[self._key(h, c)] = block
                self._block_key[block] = (h, parent, tokens, c)
                self._pinned.append((block, c))
        return out

    def end_step(self) -> None:
        """The scheduled step has run: unpin its snapshots (they stay cached, on the free list)
        and the hit snapshots it copied from."""
        if self._pinned:
            decref = self.pool.decref
            for block, _ in self._pinned:
                decref(block)
            self._pinned.clear()

    def _use_state_hit(self, seq_id: int, blocks: list[int]) -> list[int]:
        """`use_prefix` of a state model: the hit's last row holds the snapshot blocks in its
        state columns (`match_prefix`; acquired): they come out of the table, pinned until
        copied, and
        the first row's state columns get fresh live blocks, copies of them."""
        w, null, pool, tags = self.width, self.null, self.pool, self._col_tag
        blocks = list(blocks)
        last = len(blocks) - w
        pending = []
        for c in self._state_cols:
            snap = blocks[last + c]
            blocks[last + c] = null  # (acquired by `use_prefix`: that reference is the pin)
            live = pool.allocate(tags[c])
            blocks[c] = live
            pending.append((snap, live, c))
        self._hit_copies[seq_id] = pending
        return blocks

    def take_hit_copies(self) -> list[tuple[int, int]]:
        """The (snapshot -> live) copies of the sequences started from a snapshot since the
        last call, for this step's copies (whether or not the sequence computes in this step:
        its live state is initialised at once); their snapshots stay pinned until it has run."""
        if not self._hit_copies:
            return []
        copies = []
        for pending in self._hit_copies.values():
            self._pinned.extend((snap, c) for snap, _, c in pending)
            copies.extend((snap, live) for snap, live, _ in pending)
        self._hit_copies.clear()
        return copies

    def _swap_sources(self, seq_ids) -> dict[int, int]:
        """Live state block -> its snapshot, for the sequences swapped out in the step that
        started them from a snapshot (their copy has not run: the snapshot holds the state);
        their copies are dropped, the snapshots pinned until the step has run."""
        source = {}
        for seq_id in seq_ids:
            for snap, live, c in self._hit_copies.pop(seq_id, ()):
                source[live] = snap
                self._pinned.append((snap, c))
        return source

    @property
    def holds_pinned_snapshots(self) -> bool:
        """Whether snapshot blocks are pinned until the step being scheduled has run (they go
        back to the free list at `end_step`)."""
        return bool(self._pinned or self._hit_copies)

    def _drop_hit(self, seq_id: int) -> None:
        """A sequence started from a snapshot is freed in the same step: no copy."""
        for snap, _, _ in self._hit_copies.pop(seq_id, ()):
            self.pool.decref(snap)

    def _pinned_blocks(self):
        """(block, column) of every block the manager itself holds a reference to."""
        yield from self._pinned
        for pending in self._hit_copies.values():
            for snap, _, c in pending:
                yield snap, c
