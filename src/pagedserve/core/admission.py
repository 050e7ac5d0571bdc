"""Admission: the first plan of a waiting group and the prefix-cache hits it starts from (a
`Scheduler` part). Pure Python, no torch.

`_plan_admission` is asked for the group at the head of the waiting queue: its prefix hits
(`_prefix_hits`, tentatively taken as computed), its first chunk (`plan_tokens`), and whether
the blocks that takes (`_blocks_to_admit`: new ones, and the cached ones now on the free list)
are free. NOTE: every request the engine admits fits the empty pool alone; a plan that would
not (a hit that costs more than it saves) is made again without the hits, or the request would
wait for good.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.core.step_budget import plan_tokens
from pagedserve.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedserve.core.kv_cache_manager import KVCacheManager
    from pagedserve.core.sched_types import Plan, SchedulerConfig


class Admission:
    """The admission half of `Scheduler` (it needs `self.kv`, `self.config`, `self._align`
    and `self._snapshots`)."""

    kv: "KVCacheManager"
    config: "SchedulerConfig"
    _align: int
    _snapshots: bool

    def _prefix_hits(self, group: SequenceGroup) -> list[tuple[Sequence, list[int]]]:
        """Cached leading blocks for each sequence of a group about to be admitted.

        NOTE: a request asking for prompt logprobs, or pooling more than the last token, computes
        its whole prompt (no cached positions are skipped); a forking group looks up its parent
        only.
        """
        if not self.kv.enable_prefix_caching or (
            group.sampling_params.prompt_logprobs is not None and not group.prompt_logprobs_done
        ):
            return []
        if group.pooling is not None and group.pooling.needs_whole_prompt:
            return []  # mean / CLS / per-token pooling read every prompt position's state
        seqs = group.unfinished_seqs()
        if group.fork_pending:
            seqs = seqs[:1]
        hits = []
        for seq in seqs:
            if seq.seq_id in self.kv.tables or seq.num_computed_tokens:
                continue
            blocks = self.kv.match_prefix(seq.token_ids[: self._lookup_len(group, seq)],
                                          seq.cache_salt)
            if blocks:
                hits.append((seq, blocks))
            if self._snapshots:  # (its chunk ends where the cached attention ends: snapshot)
                seq.snapshot_at = self.kv.junction_tokens
        return hits

    def _plan_admission(self, group: SequenceGroup, budget: int):
        """(plan, prefix hits) for a waiting group whose blocks are free now, else None (it
        waits). NOTE: a hit can cost more blocks than it saves (a state model's snapshot stays
        pinned through the step beside the sequence's own state blocks): where the plan with
        the hit would not fit even the empty pool, the group starts without it (it waited for
        good before: a hang)."""
        hits = self._prefix_hits(group)
        for attempt in ((hits, []) if hits else ([],)):
            for seq, blocks in hits:  # tentatively: the cached tokens need no computing
                seq.num_computed_tokens = self.kv.hit_tokens(blocks) if attempt else 0
            plan = plan_tokens(self.config, group, budget, self._align)
            if plan is None:
                continue
            need = self._blocks_to_admit(plan, {q.seq_id: b for q, b in attempt})
            if need <= self.kv.num_free_blocks:
                return plan, attempt
            if need <= self.kv.num_blocks:
                break  # (it fits once blocks are freed)
        for seq, _ in hits:
            seq.num_computed_tokens = 0
        return None

    @staticmethod
    def _lookup_len(group: SequenceGroup, seq: Sequence) -> int:
        """Tokens of `seq` looked up in the prefix cache (a forking parent's prompt only)."""
        return seq.num_prompt_tokens if group.fork_pending else seq.num_tokens

    def _blocks_to_admit(self, plan: "Plan", hits: dict[int, list[int]]) -> int:
        """Free blocks that admitting `plan` takes: new blocks beyond the cached ones, plus the
        cached ones that currently sit on the free list."""
        need = 0
        for seq, _, end in plan:
            cached = hits.get(seq.seq_id)
            if cached is None:
                need += self.kv.num_new_blocks(seq.seq_id, end)
            else:
                need += self.kv.num_blocks_to_map(end, cached)
        return need
