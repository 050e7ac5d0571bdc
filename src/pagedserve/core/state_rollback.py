"""Speculative decoding for models with a recurrent state (Gated DeltaNet, Mamba): the state
before a speculative row is kept, so that rejected drafts can be rolled back. Pure Python; a
mixin of `KVCacheManager`.

A speculative row feeds the sequence's last token and its `d` drafts through every layer; a
recurrent layer rewrites its state over all `1 + d` of them in place. When a draft is rejected
the state has seen tokens that the sequence will never hold, and a state cannot be cut back the
way a table's slots are (`KVCacheManager.truncate`). So:

1. When a speculative row is allocated (`allocate_slots(..., keep_state=True)`), each of the
   sequence's state blocks is replaced by a fresh copy of itself, as copy-on-write does for a
   shared one (the copy runs with the step's copies, before the step writes): the step writes
   the copy, and the block it held before, untouched, is kept as the *backup* (the manager holds
   its reference).
2. After the step (`settle_state`): all drafts accepted -> the backups are released; a draft
   rejected -> the backups go back into the table (the rewritten copies are released), and the
   caller sets the sequence's computed tokens back to the row's start. The tokens the row
   produced (the accepted drafts and the next token) are kept; the next step computes them again
   from the restored state as one row (with no drafts), whose last position samples the next
   token. Rows are computed token by token in one fixed order, so the restored state and the
   recomputed one are bit for bit those of a run without speculation.

NOTE: a backup lives from the allocation of a speculative row to that step's `settle_state`;
undoing the allocation (`restore`) or freeing the sequence drops it. A sequence with a backup is
never swapped out (the scheduler unschedules a victim before it preempts it).
"""

from __future__ import annotations


class StateRollback:
    """The recurrent-state rollback of speculative rows (see the module docstring)."""

    def _init_rollback(self) -> None:
        # Per sequence with a speculative row in the step being scheduled: the state blocks it
        # held before the row (in `_state_cols` order), each with the manager's reference.
        self._state_backups: dict[int, list[int]] = {}
        self.state_rollbacks = 0  # speculative rows whose state was rolled back

    def _backup_states(self, seq_id: int, table, copies: list[tuple[int, int]]) -> None:
        """Replace each state block of `seq_id` with a fresh copy (appended to `copies`), keeping
        the block it held as the backup (its reference moves to the manager)."""
        if seq_id in self._state_backups:
            raise RuntimeError(f"sequence {seq_id}: two speculative rows in one step")
        blocks, pool, tags = table.blocks, self.pool, self._col_tag
        backup = []
        for c in self._state_cols:
            old = blocks[c]
            new = pool.allocate(tags[c])
            blocks[c] = new
            copies.append((old, new))
            backup.append(old)
            table.changed_from(c)
        self._state_backups[seq_id] = backup

    def has_state_backup(self, seq_id: int) -> bool:
        """Whether `seq_id` ran a speculative row whose state can still be rolled back."""
        return seq_id in self._state_backups

    def settle_state(self, seq_id: int, keep_new: bool) -> bool:
        """After `seq_id`'s speculative row has run: keep the state it wrote (`keep_new`: every
        draft was accepted; the backup is released) or roll back to the backup (the rewritten
        blocks are released). Returns whether the new state was kept; True without a backup."""
        backup = self._state_backups.pop(seq_id, None)
        if backup is None:
            return True
        pool = self.pool
        if keep_new:
            for old in backup:
                pool.decref(old)
            return True
        table = self.tables[seq_id]
        blocks = table.blocks
        for c, old in zip(self._state_cols, backup):
            pool.decref(blocks[c])
            blocks[c] = old
            table.changed_from(c)
        self.state_rollbacks += 1
        return False

    def _undo_backup(self, seq_id: int, blocks: list[int]) -> None:
        """`restore` of an allocation that backed up the state: the backups go back into
        `blocks` (the copies are released) before the rest of the table is put back."""
        backup = self._state_backups.pop(seq_id, None)
        if backup is None:
            return
        decref = self.pool.decref
        for c, old in zip(self._state_cols, backup):
            decref(blocks[c])
            blocks[c] = old

    def _drop_backup(self, seq_id: int) -> None:
        """The sequence is freed: its backups are released."""
        for old in self._state_backups.pop(seq_id, ()):
            self.pool.decref(old)

    def _backup_blocks(self):
        """(block, column) of every backup the manager holds."""
        for backup in self._state_backups.values():
            yield from zip(backup, self._state_cols)
