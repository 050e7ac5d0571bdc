"""Turns: the sequences of a group that cannot all be resident at once (a `Scheduler` part).
Pure Python, no torch.

A group alone in the cache whose sequences cannot all hold their blocks gives up all-or-nothing
residency (README "Preemption"): `_turn_victim` picks the sequence that gives its blocks back,
`_park` frees them (the sequence is recomputed exactly later, from its tokens), `_unpark` brings
parked sequences back, in order, when the blocks of all their tokens are free with one to spare
per resident sibling, mapping the prompt's full blocks of a resident sibling or the prefix cache
(`_shareable_prefix`).

NOTE: the first sequence a group computes in a step is never parked, and it fits the pool alone
(the engine admits only requests one of whose sequences alone fits): the group always advances.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedserve.core.kv_cache_manager import KVCacheManager
    from pagedserve.core.sched_types import Plan


class Turns:
    """The turn-taking half of `Scheduler` (it needs `self.kv` and counts `self.num_turns`)."""

    kv: "KVCacheManager"
    num_turns: int

    def _turn_victim(self, group: SequenceGroup, plan: "Plan") -> Sequence | None:
        """The sequence of a group alone in the cache that gives its blocks back: the last
        resident one not computing this step, else the last one computing, never the first one
        computing (it always fits alone). None if only that one is left."""
        planned = {id(q) for q, _, _ in plan}
        resident = [q for q in group.unfinished_seqs()
                    if not q.parked and q.seq_id in self.kv.tables]
        idle = [q for q in resident if id(q) not in planned]
        if idle:
            return idle[-1]
        busy = [q for q, _, _ in plan[1:]]
        return busy[-1] if busy else None

    def _trim_to_fit(self, entry: tuple) -> tuple | None:
        """The last sequence computing, alone and short of blocks: `entry` (seq, start, end)
        cut to the longest chunk whose blocks are free now (at least one token), or None."""
        seq, start, end = entry
        kv = self.kv
        for stop in range(min(end, seq.num_tokens) - 1, start, -1):
            if kv.num_new_blocks(seq.seq_id, stop) <= kv.num_free_blocks:
                return seq, start, stop
        return None

    def _park(self, group: SequenceGroup, seq: Sequence) -> None:
        """Free a sequence's blocks; it is recomputed from its tokens when its turn comes."""
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.parked = True
        self.num_turns += 1

    def _unpark(self, group: SequenceGroup, parked: list[Sequence]) -> None:
        """Bring parked sequences back, in order, while the blocks of all their tokens are free
        with one to spare for every resident sibling (so that they do not push a sibling out
        at once). A beam holding its candidates stays parked until the beam step."""
        resident = sum(1 for q in group.unfinished_seqs() if not q.parked)
        for seq in parked:
            if seq.beam_candidates is not None:
                continue
            shared = self._shareable_prefix(group, seq)
            need = self.kv.num_blocks_to_map(seq.num_tokens, shared)
            if resident and need + resident > self.kv.num_free_blocks:
                break
            self._unpark_one(group, seq, shared)
            resident += 1

    def _unpark_one(self, group: SequenceGroup, seq: Sequence,
                    shared: list[int] | None = None) -> None:
        if shared is None:
            shared = self._shareable_prefix(group, seq)
        # (an empty table when nothing is shared: a resident sequence always has one)
        # (the tokens it maps: fewer than `shared` holds where the blocks cannot be taken)
        seq.num_computed_tokens = self.kv.share_blocks(seq.seq_id, shared, seq.cache_salt)
        seq.parked = False

    def _shareable_prefix(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """Computed blocks a returning sequence can map instead of recomputing them: the full
        prompt blocks of its most advanced resident sibling, or its longest prefix in the prefix
        cache if longer. At least its last token is left to compute."""
        bs = self.kv.block_size
        limit = (seq.num_tokens - 1) // bs
        best: list[int] = []
        for q in group.unfinished_seqs():
            if q is seq or q.parked or q.seq_id not in self.kv.tables:
                continue
            k = min(limit, seq.num_prompt_tokens // bs, q.num_computed_tokens // bs)
            if k * self.kv.width > len(best):
                shared = self.kv.shareable_prefix(q.seq_id, k)
                if len(shared) > len(best):
                    best = shared
        if self.kv.enable_prefix_caching:
            cached = self.kv.match_prefix(seq.token_ids[: limit * bs + 1], seq.cache_salt)
            if len(cached) > len(best):
                best = cached
        return best
