"""Preemption of the scheduler (core/scheduler.py): a whole group is evicted, by swapping its
blocks to the CPU pool or by dropping them for recomputation (the paper's all-or-nothing
policy). Pure Python; a mixin of `Scheduler`."""

from __future__ import annotations

from pagedserve.core.sched_types import SchedulerOutput
from pagedserve.sequence import SequenceGroup, SequenceStatus


class Preemption:
    """The scheduler's evictions (see the module docstring)."""

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Evict a whole group: swap its blocks to the CPU pool when the mode says so and the
        pool has room, else drop them and requeue it for recomputation at the front."""
        seq_ids = [s.seq_id for s in group.unfinished_seqs()]
        for seq in group.seqs:
            if seq.is_finished:
                self.kv.free(seq.seq_id)
        group.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group)
        if self._should_swap(group, seq_ids):
            out.blocks_to_swap_out.extend(self.kv.swap_out(seq_ids))
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.SWAPPED
            self.swapped.add(group)
            self.preemptions_by_mode["swap"] += 1
            return
        self._requeue_for_recompute(group)
        self.preemptions_by_mode["recompute"] += 1

    def _requeue_for_recompute(self, group: SequenceGroup) -> None:
        """Drop a group's blocks (device and CPU) and put it back in the waiting queue (by its
        arrival: ahead of every newer request); it prefills its prompt once again, forks, and
        each sequence recomputes its output."""
        for seq in group.unfinished_seqs():
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            seq.parked = False
        # NOTE: prompt logprobs of a prompt cut short are computed again from its start.
        if not group.prompt_logprobs_done and group.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        # Recompute the shared prompt once again, then fork: the group needs no more blocks
        # than it held before.
        group.fork_pending = len(group.unfinished_seqs()) > 1
        self.waiting.add(group)

    def _should_swap(self, group: SequenceGroup, seq_ids: list[int]) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(seq_ids):
            return False
        if mode == "swap":
            return True
        blocks = self.kv.num_distinct_blocks(seq_ids)
        tokens = sum(s.num_computed_tokens for s in group.unfinished_seqs())
        swap_cost = 2 * blocks * self.config.swap_seconds_per_block
        return swap_cost < tokens * self.config.recompute_seconds_per_token
