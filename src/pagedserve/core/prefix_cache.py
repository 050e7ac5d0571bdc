"""Automatic prefix caching of the block manager (core/kv_cache_manager.py). Pure Python.

A full, computed block is registered under the chained hash of its tokens (its parent's hash and
its own tokens, rooted in the request's salt); a new request's prompt starts from the longest
prefix of cached blocks every layer group can serve. `PrefixCaching` is a mixin of
`KVCacheManager`: it reads the manager's tables, pool, layout columns and null block.
"""

from __future__ import annotations

from pagedserve.core.block_table import BlockTable, block_hash, salt_root


class PrefixCaching:
    """The prefix cache's half of `KVCacheManager` (see the module docstring)."""

    def _key(self, h: int, column: int):
        """The prefix-cache key of the block of column `column` holding hash `h`."""
        return h if self.width == 1 else (h, column)

    def _hit(self, h: int, column: int, parent: int, tokens: tuple[int, ...]) -> int:
        """The cached block of `column` for the block of hash `h` after `parent` holding
        `tokens` (its parent and tokens checked), else null."""
        block = self._cached.get(self._key(h, column))
        if block is None:
            return self.null
        _, cached_parent, cached_tokens, _ = self._block_key[block]
        if cached_parent != parent or cached_tokens != tokens:
            return self.null
        return block

    def match_prefix(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` made of full blocks (cached
        under the same `salt`: a request's `cache_salt` roots its chain of hashes, so requests
        with different salts never share blocks); with several columns, a row per logical block.

        NOTE: at least the last token is always left to compute (its logits are needed), so a
        prompt that is entirely cached gets its last block recomputed into a fresh block; a
        cached block is never written. A hit must match the block's tokens AND its parent's hash
        (the previous block of the chain, or the salt's root): two chains whose hashes collide
        never share KV. With several groups a prefix hits only if every group serves it: a
        full-attention group all its blocks, a sliding-window group the blocks inside the window
        of the hit's end (vLLM's rule; the ones before come back null), and a recurrent state
        group a snapshot of the state at the hit's end (core/state_snapshots.py: it comes back
        in the last row's state columns, null in the others).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent = salt_root(salt)
        if self._plain:
            hits: list[int] = []
            for i in range((len(token_ids) - 1) // bs):
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                h = block_hash(parent, tokens)
                block = self._hit(h, 0, parent, tokens)
                if block == self.null:
                    break
                hits.append(block)
                parent = h
            return hits
        w, null = self.width, self.null
        state = self._state_cols
        # NOTE (admission cost): a state model's state columns are looked up once, at the
        # hit's last row; per row only whether a snapshot of it is cached (`snaps`).
        cols = self._live_cols if state else range(w)
        rows: list[int] = []
        snaps: list[bool] = []
        chain: list[tuple] = []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            row = [null] * w
            for c in cols:
                row[c] = self._hit(h, c, parent, tokens)
            if any(row[c] == null for c in self._full_cols):
                break
            if state:
                snaps.append(self._hit(h, state[0], parent, tokens) != null)
                chain.append((h, parent, tokens))
            rows.extend(row)
            parent = h
        # (past the hit: the prompt's attention blocks cached beyond its last snapshot, the
        # junction where an earlier prompt went another way: `Scheduler._prefix_hits`)
        self.junction_tokens = len(rows) // w * bs if state else 0
        while True:
            k = self._usable_rows(rows, len(rows) // w, snaps)
            if not state or not k:
                break
            # the snapshot at the hit's last row: every state column's block (one may have
            # been handed out again, evicted, alone)
            h, parent, tokens = chain[k - 1]
            got = [self._hit(h, c, parent, tokens) for c in state]
            if null not in got:
                for c, block in zip(state, got):
                    rows[(k - 1) * w + c] = block
                break
            snaps[k - 1] = False
        return self._prefix_rows(rows, k)

    def _usable_prefix(self, rows: list[int], k: int) -> list[int]:
        """The longest prefix of at most `k` logical blocks of `rows` (flat, null where a block
        is missing) that a sequence can start from (`_usable_rows`, `_prefix_rows`)."""
        return self._prefix_rows(rows, self._usable_rows(rows, k))

    def _usable_rows(self, rows: list[int], k: int, snaps: list[bool] | None = None) -> int:
        """How many of the first `k` logical blocks of `rows` a sequence can start from: every
        full-attention column's blocks (complete in `rows`), each sliding-window group's blocks
        inside the window of the prefix's end, and with a recurrent state a snapshot of it at
        the prefix's last block (`snaps[i]`: one is cached for block `i`; never the first
        block's: the state columns' first row is the live state)."""
        w, bs, null = self.width, self.block_size, self.null
        state = bool(self._state_cols)
        if state and snaps is None:
            return 0
        while k > 0:
            ok = not state or (k >= 2 and snaps[k - 1])
            for first, lanes, window in self._sliding if ok else ():
                lo = max(0, (k * bs - window + 1) // bs)
                for i in range(lo, k):
                    base = i * w + first
                    if null in rows[base : base + lanes]:
                        ok = False
                        break
                if not ok:
                    break
            if ok:
                break
            k -= 1
        return k

    def _prefix_rows(self, rows: list[int], k: int) -> list[int]:
        """The first `k` logical blocks of `rows`, each sliding-window group's blocks before the
        window of their end null, and the state columns null but at the last block."""
        w, bs, null = self.width, self.block_size, self.null
        out = rows[: k * w]
        for first, lanes, window in self._sliding:
            lo = max(0, (k * bs - window + 1) // bs)
            for i in range(lo):
                base = i * w + first
                out[base : base + lanes] = [null] * lanes
        for i in range(k - 1):
            for c in self._state_cols:
                out[i * w + c] = null
        return out

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of these blocks sit on the free list (taking them costs free blocks)."""
        refs, null = self.pool.ref_counts, self.null
        return sum(1 for b in blocks if b != null and refs[b] == 0)

    def _lows(self, blocks: list[int]) -> list[int] | None:
        """Per sliding-window group, the leading logical blocks of `blocks` that are null."""
        if not self._sliding:
            return None
        w, null = self.width, self.null
        lows = []
        for first, _, _ in self._sliding:
            i = 0
            while i * w + first < len(blocks) and blocks[i * w + first] == null:
                i += 1
            lows.append(i)
        return lows

    def _acquire_all(self, blocks: list[int]) -> None:
        acquire, null, w, tags = self.pool.acquire, self.null, self.width, self._col_tag
        for i, block in enumerate(blocks):
            if block != null:
                acquire(block, tags[i % w])

    def _known_hashes(self, blocks: list[int], parent: int) -> list[int]:
        """The chained hashes of the leading logical blocks of `blocks` as far as the prefix
        cache knows them, each block's parent checked (`cache_full_blocks` computes the rest)."""
        w, null = self.width, self.null
        hashes: list[int] = []
        for i in range(len(blocks) // w):
            key = next((self._block_key.get(b) for b in blocks[i * w : (i + 1) * w]
                        if b != null and b in self._block_key), None)
            if key is None or key[1] != parent:
                break
            hashes.append(key[0])
            parent = key[0]
        return hashes

    def use_prefix(self, seq_id: int, blocks: list[int]) -> int:
        """Start `seq_id`'s table with cached blocks (`match_prefix`'s); returns the number of
        tokens they hold."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self._acquire_all(blocks)
        if self._plain:
            hashes = [self._block_key[b][0] for b in blocks]
        else:
            # the hash of each row from a block of it (a row of null blocks: unknown, None)
            w, null, hashes = self.width, self.null, []
            for i in range(len(blocks) // w):
                b = next((b for b in blocks[i * w : (i + 1) * w] if b != null), None)
                hashes.append(None if b is None else self._block_key[b][0])
        if self._state_cols and blocks:  # (the snapshot out, the live state in)
            blocks = self._use_state_hit(seq_id, blocks)
        table = BlockTable(list(blocks), self.hit_tokens(blocks), hashes, self._lows(blocks))
        self.tables[seq_id] = table
        return table.num_tokens

    def shareable_prefix(self, seq_id: int, num_blocks: int) -> list[int]:
        """The leading logical blocks (at most `num_blocks`, computed: the caller's to ensure) of
        `seq_id`'s table that another sequence can start from (`share_blocks`): with a
        sliding-window group, only as far as its blocks inside the window of the end are held."""
        blocks = self.block_table(seq_id)[: num_blocks * self.width]
        if self._plain:
            return list(blocks)
        if self._state_cols:  # (the state is the holder's, past these blocks)
            return []
        return self._usable_prefix(list(blocks), len(blocks) // self.width)

    def share_blocks(self, seq_id: int, blocks: list[int], salt: str | None = None) -> int:
        """Start `seq_id`'s table with these full, computed blocks that other tables hold or the
        prefix cache keeps (shared: reference counts go up). Their hashes are kept as far as the
        prefix cache knows the chain (under `salt`); `cache_full_blocks` computes the rest.
        Returns the tokens they hold: none when a state snapshot's hit finds no free blocks for
        the sequence's live state (the table then starts empty)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        if self._state_cols and blocks and \
                self.num_free_among(blocks) + len(self._state_cols) > self.pool.num_free:
            blocks = []  # (no room for the live state a snapshot needs: nothing is shared)
        self._acquire_all(blocks)
        hashes = self._known_hashes(blocks, salt_root(salt))
        if self._state_cols and blocks:  # (a prefix-cache hit: the snapshot out, the state in)
            blocks = self._use_state_hit(seq_id, blocks)
        table = BlockTable(list(blocks), self.hit_tokens(blocks), hashes, self._lows(blocks))
        self.tables[seq_id] = table
        return table.num_tokens

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int,
                          salt: str | None = None) -> None:
        """Register the sequence's newly full and computed blocks in the prefix cache (each
        block's hash is computed once), under its `salt` (see `match_prefix`)."""
        table = self.tables.get(seq_id)
        if not self.enable_prefix_caching or table is None:
            return
        bs, w, null = self.block_size, self.width, self.null
        hashes, blocks = table.hashes, table.blocks
        # (a state model's live state is not cached: snapshots of it are, `take_snapshots`)
        cols = self._live_cols if self._state_cols else range(w)
        event_col = self._event_col
        for i in range(len(hashes), min(num_computed, table.num_tokens) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hashes[-1] if hashes else salt_root(salt)
            if parent is None:  # (a leading row of unknown hash: use_prefix of null rows)
                parent = self._chain_hash(token_ids, i, salt)
            h = block_hash(parent, tokens)
            hashes.append(h)
            for c in cols:
                block = blocks[i * w + c]
                key = self._key(h, c)
                if block != null and key not in self._cached and block not in self._block_key:
                    self._cached[key] = block
                    self._block_key[block] = (h, parent, tokens, c)
                    # NOTE: events speak of the first group's blocks only: a prefix is served
                    # when every group has it, and routers index token chains, not groups.
                    if c == event_col and self.events is not None:
                        self.events.stored(h, hashes[i - 1] if i else None, tokens, salt)

    def _chain_hash(self, token_ids: list[int], n: int, salt) -> int:
        """The chained hash of the first `n` blocks of `token_ids`."""
        bs, h = self.block_size, salt_root(salt)
        for i in range(n):
            h = block_hash(h, tuple(token_ids[i * bs : (i + 1) * bs]))
        return h

    def _forget(self, block: int) -> None:
        key = self._block_key.pop(block, None)
        if key is not None:
            k = self._key(key[0], key[3])
            if self._cached.get(k) == block:
                del self._cached[k]
                if key[3] == self._event_col and self.events is not None:
                    self.events.removed(key[0])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (their contents stay until reused, never matched again).
        Only while no block is in use: False (and nothing changed) otherwise."""
        self.end_step()  # (between steps: the last one's snapshots have been copied)
        if self.pool.num_used:
            return False
        self._cached.clear()
        self._block_key.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
