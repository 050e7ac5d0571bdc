"""Iteration-level FCFS scheduler with all-or-nothing preemption. Pure Python, no torch.

Every step `schedule()` picks the tokens to compute: first one decode token (or the rest of a
prompt chunk) for every running request in arrival order, allocating blocks as they fill; then,
when nothing was preempted, new requests from the waiting queue in arrival order, as long as their
tokens fit the step's budget and their blocks fit the free pool. When a running request needs a
block and none is free, the most recently arrived running request is preempted (all its
sequences), its blocks freed, and it goes back to the front of the waiting queue to be recomputed.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step, and how preempted requests are recovered.

    `preemption_mode="auto"` swaps a group when the estimated swap time (out and back in:
    `2 * blocks * swap_seconds_per_block`) is below the estimated recompute time
    (`tokens * recompute_seconds_per_token`); the engine derives both figures from the model and
    the device. Every mode falls back to recomputation when the CPU pool is full.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = False
    preemption_mode: str = "recompute"
    swap_seconds_per_block: float = 0.0
    recompute_seconds_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
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
    # Tokens to draw from this row: all sequences' first tokens when the group forks after it.
    num_samples: int = 1

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
        do_sample = end == seq.num_tokens
        forking = group.fork_pending and do_sample and group.beam is None
        forks = len(group.unfinished_seqs()) if forking else 1
        return cls(group, seq, start, end, table, do_sample, wants, forks)


@dataclass
class SchedulerOutput:
    """What one step computes, handed to the model runner."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # NOTE: the worker applies these in this order, before the forward pass: swap out (device ->
    # cpu), swap in (cpu -> device), then copy-on-write copies. A block freed by a swap-out may be
    # handed to another sequence in the same step; its contents are saved first.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Requests that ended since the last step: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Groups that could not grow even alone in the cache: finished with "length" this step.
    length_capped: list[SequenceGroup] = field(default_factory=list)
    # Structured outputs: the constrained rows' token bitmasks (a
    # `structured_output.bitmask.GrammarBitmask`), set by the engine after scheduling.
    grammar_bitmask: object | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous-batching scheduler over a `KVCacheManager`; see the module docstring.

    Queues: `waiting` (new, and preempted-by-recomputation at the front), `running` (sorted by
    arrival), `swapped` (preempted by swapping, sorted by arrival).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.preemptions_by_mode = {"recompute": 0, "swap": 0}

    # --- queue management --------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request (validated by the engine)."""
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is, free its blocks, mark its sequences aborted."""
        for queue in (self.running, self.waiting, self.swapped):
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
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    def _release(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
        self._finished_ids.append(group.request_id)

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens; allocate their blocks; preempt when the pool runs dry.

        Order: decode tokens of running requests first (so that a long prompt never stalls every
        stream), then prompt chunks of running requests, then swapped requests coming back, then
        new requests (only when nothing is swapped out and nothing was preempted this step).
        """
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        step = _Step(self.config.max_num_batched_tokens)

        decoding = [g for g in self.running if self._is_decoding(g)]
        prefilling = [g for g in self.running if not self._is_decoding(g)]
        for group in decoding + prefilling:
            if group in self.running and step.budget > 0:
                self._schedule_running(group, step, out)

        while self.swapped and not out.preempted and step.budget > 0:
            group = self.swapped[0]
            seq_ids = [s.seq_id for s in group.unfinished_seqs()]
            plan = self._plan(group, step.budget)
            need = self._blocks_to_swap_in(plan) if plan else 0
            if (plan is None or need > self.kv.num_free_blocks
                    or self._num_seqs() + len(seq_ids) > self.config.max_num_seqs):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.kv.swap_in(seq_ids))
            self._set_running(group)
            self._commit(plan, group, step, out)

        while self.waiting and not self.swapped and not out.preempted and step.budget > 0:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()
            if self._num_seqs() + len(seqs) > self.config.max_num_seqs:
                break
            hits = self._prefix_hits(group)
            for seq, blocks in hits:  # tentatively: the cached tokens need no computing
                seq.num_computed_tokens = len(blocks) * self.kv.block_size
            plan = self._plan(group, step.budget)
            if plan is None or self._blocks_to_admit(plan, dict(
                    (seq.seq_id, blocks) for seq, blocks in hits)) > self.kv.num_free_blocks:
                for seq, _ in hits:
                    seq.num_computed_tokens = 0
                break
            for seq, blocks in hits:
                self.kv.prefix_hits += self.kv.use_prefix(seq.seq_id, blocks)
            if self.kv.enable_prefix_caching:
                self.kv.prefix_queries += sum(self._lookup_len(group, seq) for seq, _, _ in plan)
            self.waiting.popleft()
            self._set_running(group)
            self._commit(plan, group, step, out)
        return out

    def _prefix_hits(self, group: SequenceGroup) -> list[tuple[Sequence, list[int]]]:
        """Cached leading blocks for each sequence of a group about to be admitted.

        NOTE: a request asking for prompt logprobs computes its whole prompt (no cached
        positions are skipped); a forking group looks up its parent only.
        """
        if not self.kv.enable_prefix_caching or (
            group.sampling_params.prompt_logprobs is not None and not group.prompt_logprobs_done
        ):
            return []
        seqs = group.unfinished_seqs()
        if group.fork_pending:
            seqs = seqs[:1]
        hits = []
        for seq in seqs:
            if seq.seq_id in self.kv.tables or seq.num_computed_tokens:
                continue
            blocks = self.kv.match_prefix(seq.token_ids[: self._lookup_len(group, seq)])
            if blocks:
                hits.append((seq, blocks))
        return hits

    @staticmethod
    def _lookup_len(group: SequenceGroup, seq: Sequence) -> int:
        """Tokens of `seq` looked up in the prefix cache (a forking parent's prompt only)."""
        return seq.num_prompt_tokens if group.fork_pending else seq.num_tokens

    def _blocks_to_admit(self, plan, hits: dict[int, list[int]]) -> int:
        """Free blocks that admitting `plan` takes: new blocks beyond the cached ones, plus the
        cached ones that currently sit on the free list."""
        need = 0
        for seq, _, end in plan:
            cached = hits.get(seq.seq_id)
            if cached is None:
                need += self.kv.num_new_blocks(seq.seq_id, end)
            else:
                need += cdiv(end, self.kv.block_size) - len(cached)
                need += self.kv.num_free_among(cached)
        return need

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer a sequence's newly computed full blocks to the prefix cache."""
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def _schedule_running(self, group: SequenceGroup, step: "_Step", out: SchedulerOutput) -> None:
        plan = self._plan(group, step.budget)
        if plan is None:
            return
        while not self._fits(plan):
            victim = self.running[-1]
            if victim is group and len(self.running) == 1:
                # Alone in the cache and still no room: it can never grow.
                self.running.pop()
                for seq in group.unfinished_seqs():
                    self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                self._release(group)
                out.length_capped.append(group)
                return
            self.running.pop()
            step.unschedule(victim, out)
            self._preempt(victim, out)
            if victim is group:
                return
        self._commit(plan, group, step, out)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks (shared, copy-on-write) and computed tokens."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = parent.status

    def drop_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Remove a pruned beam from its group and free its blocks."""
        self.kv.free(seq.seq_id)
        group.seqs.remove(seq)

    def fork_if_ready(self, group: SequenceGroup) -> list[Sequence]:
        """Once the parent of a forking group has computed its prompt, give the other sequences
        its blocks (shared, copy-on-write) and its computed prompt. Returns the sequences, parent
        first, or [] if the group is not forking now."""
        seqs = group.unfinished_seqs()
        if not group.fork_pending or seqs[0].num_computed_tokens < seqs[0].num_prompt_tokens:
            return []
        parent = seqs[0]
        for child in seqs[1:]:
            self.fork(parent, child)
        group.fork_pending = False
        return seqs

    def _blocks_to_swap_in(self, plan) -> int:
        """Device blocks a swapped group needs to come back and run `plan`: its distinct CPU
        blocks, the blocks its new tokens fill, and one copy-on-write block per sequence (an
        upper bound)."""
        seq_ids = [seq.seq_id for seq, _, _ in plan]
        grow = sum(
            max(0, cdiv(end, self.kv.block_size) - len(self.kv.cpu_tables[seq.seq_id].blocks)) + 1
            for seq, _, end in plan
        )
        return self.kv.num_distinct_blocks(seq_ids, cpu=True) + grow

    def _is_decoding(self, group: SequenceGroup) -> bool:
        return all(s.num_tokens - s.num_computed_tokens == 1 for s in group.unfinished_seqs())

    def _num_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    def _set_running(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.RUNNING
        # NOTE: `running` stays sorted by arrival: the victim of a preemption is its last entry.
        bisect.insort(self.running, group, key=lambda g: g.arrival_time)

    def _plan(self, group: SequenceGroup, budget: int):
        """(seq, start, end) for each unfinished sequence of the group within `budget`, or None
        if the group cannot be scheduled this step."""
        chunked = self.config.enable_chunked_prefill
        plan = []
        seqs = group.unfinished_seqs()
        if group.fork_pending:
            seqs = seqs[:1]
        for seq in seqs:
            start = seq.num_computed_tokens
            # A group that will fork computes the parent's prompt alone, then the others share it.
            stop = seq.num_prompt_tokens if group.fork_pending else seq.num_tokens
            want = stop - start
            if want <= 0:  # a beam waiting for its siblings' candidates: nothing to compute
                continue
            take = min(want, budget) if chunked else want
            if take > budget or take <= 0:
                return None
            plan.append((seq, start, start + take))
            budget -= take
        return plan or None

    def _fits(self, plan) -> bool:
        need = sum(self.kv.num_new_blocks(seq.seq_id, end) for seq, _, end in plan)
        return need <= self.kv.num_free_blocks

    def _commit(self, plan, group: SequenceGroup, step: "_Step", out: SchedulerOutput) -> None:
        for seq, start, end in plan:
            copies = self.kv.allocate_slots(seq.seq_id, end)
            out.blocks_to_copy.extend(copies)
            out.scheduled.append(
                ScheduledSequence.make(group, seq, start, end, self.kv.block_table(seq.seq_id))
            )
            step.record(group, end - start)

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
            bisect.insort(self.swapped, group, key=lambda g: g.arrival_time)
            self.preemptions_by_mode["swap"] += 1
            return
        for seq in group.unfinished_seqs():
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        # Recompute the shared prompt once again, then fork: the group needs no more blocks
        # than it held before.
        group.fork_pending = len(group.unfinished_seqs()) > 1
        self.waiting.appendleft(group)
        self.preemptions_by_mode["recompute"] += 1

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


class _Step:
    """Book-keeping of the step being scheduled, so that a preempted victim that was already
    scheduled this step can be taken out again."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._used: dict[str, int] = {}

    def record(self, group: SequenceGroup, num_tokens: int) -> None:
        self.budget -= num_tokens
        self._used[group.request_id] = self._used.get(group.request_id, 0) + num_tokens

    def unschedule(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        used = self._used.pop(group.request_id, 0)
        if not used:
            return
        self.budget += used
        mine = {id(s) for s in group.seqs}
        dropped = [s for s in out.scheduled if id(s.seq) in mine]
        out.scheduled = [s for s in out.scheduled if id(s.seq) not in mine]
        # Its copy-on-write targets are about to be freed: no copy needed.
        targets = {b for s in dropped for b in s.block_table}
        out.blocks_to_copy = [p for p in out.blocks_to_copy if p[1] not in targets]
