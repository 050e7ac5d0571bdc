"""Iteration-level FCFS scheduler with all-or-nothing preemption. Pure Python, no torch.

Every step `schedule()` picks the tokens to compute: first one decode token (or the rest of a
prompt chunk) for every running request in arrival order, allocating blocks as they fill; then,
when nothing was preempted, new requests from the waiting queue in arrival order, as long as their
tokens fit the step's budget and their blocks fit the free pool. When a running request needs a
block and none is free, the most recently arrived running request is preempted (all its
sequences), its blocks freed, and it goes back to the front of the waiting queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or a long prompt could never be "
                "scheduled"
            )


@dataclass
class ScheduledSequence:
    """The tokens of one sequence to compute this step: `seq.token_ids[start:end]`.

    NOTE: `do_sample` and `wants_prompt_logprobs` are fixed when the step is scheduled; the
    sequence itself changes once the step's token is appended.
    """

    group: SequenceGroup
    seq: Sequence
    start: int
    end: int
    block_table: list[int]
    # True when this step reaches the sequence's last token, so the next one is sampled.
    do_sample: bool = False
    wants_prompt_logprobs: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @classmethod
    def make(cls, group: SequenceGroup, seq: Sequence, start: int, end: int, table: list[int]):
        wants = (
            group.sampling_params.prompt_logprobs is not None
            and not group.prompt_logprobs_done
            and seq is group.seqs[0]
            and start < seq.num_prompt_tokens
        )
        return cls(group, seq, start, end, table, end == seq.num_tokens, wants)


@dataclass
class SchedulerOutput:
    """What one step computes, handed to the model runner."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Requests that ended since the last step: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Groups that could not grow even alone in the cache: finished with "length" this step.
    length_capped: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous-batching scheduler over a `KVCacheManager`; see the module docstring."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # --- queue management --------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request (validated by the engine)."""
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is, free its blocks, mark its sequences aborted."""
        for queue in (self.running, self.waiting):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if not seq.is_finished:
                            seq.status = SequenceStatus.FINISHED_ABORTED
                    self._release(group)
                    return group
        return None

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """End one sequence and free its blocks; the group leaves `running` when all are done."""
        seq.status = status
        self.kv.free(seq.seq_id)

    def remove_finished(self) -> list[SequenceGroup]:
        """Drop groups whose sequences all finished from `running`; return them."""
        done = [g for g in self.running if g.is_finished]
        if done:
            self.running = [g for g in self.running if not g.is_finished]
            for group in done:
                self._release(group)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    def _release(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
        self._finished_ids.append(group.request_id)

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens; allocate their blocks; preempt when the pool runs dry."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            plan = self._plan(group, budget, chunked)
            if plan is None:  # only without chunked prefill: the prompt must go whole
                break
            while not self._fits(plan):
                victim = self.running[-1]
                if victim is group and i == 0:
                    # Alone in the cache and still no room: it can never grow.
                    self.running.pop()
                    for seq in group.unfinished_seqs():
                        self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                    self._release(group)
                    out.length_capped.append(group)
                    plan = None
                    break
                self._preempt(self.running.pop())
                out.preempted.append(victim)
                if victim is group:
                    plan = None
                    break
            if plan is None:
                if group not in self.running:
                    continue  # preempted or capped: the next group now sits at index i
                break
            budget -= self._commit(plan, group, out)
            i += 1

        # 2. New (or preempted) requests, FCFS, only if nobody was preempted this step.
        num_seqs = sum(len(g.unfinished_seqs()) for g in self.running)
        while self.waiting and not out.preempted and budget > 0:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            plan = self._plan(group, budget, chunked)
            if plan is None or not self._fits(plan):
                break
            self.waiting.popleft()
            self.running.append(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            num_seqs += len(seqs)
            budget -= self._commit(plan, group, out)
        return out

    def _plan(self, group: SequenceGroup, budget: int, chunked: bool):
        """(seq, start, end) for each unfinished sequence of the group within `budget`, or None
        if the group cannot be scheduled this step."""
        plan = []
        for seq in group.unfinished_seqs():
            start = seq.num_computed_tokens
            want = seq.num_tokens - start
            take = min(want, budget) if chunked else want
            if take > budget or take <= 0:
                return None
            plan.append((seq, start, start + take))
            budget -= take
        return plan or None

    def _fits(self, plan) -> bool:
        need = sum(self.kv.num_new_blocks(seq.seq_id, end) for seq, _, end in plan)
        return need <= self.kv.num_free_blocks

    def _commit(self, plan, group: SequenceGroup, out: SchedulerOutput) -> int:
        used = 0
        for seq, start, end in plan:
            out.blocks_to_copy.extend(self.kv.allocate_slots(seq.seq_id, end))
            out.scheduled.append(
                ScheduledSequence.make(group, seq, start, end, self.kv.block_table(seq.seq_id))
            )
            used += end - start
        return used

    def _preempt(self, group: SequenceGroup) -> None:
        """Evict a whole group by recomputation: free its blocks, requeue it at the front."""
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
            if not seq.is_finished:
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
        group.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(group)

    def blocks_needed_for_prompt(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.kv.block_size)
