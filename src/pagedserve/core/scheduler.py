"""Iteration-level FCFS scheduler with all-or-nothing preemption. Pure Python, no torch.

Every step `schedule()` picks the tokens to compute: decode tokens, then prompt (or
recomputation) chunks of the running requests in arrival order, allocating blocks as they fill;
then swapped requests coming back; then, when nothing was preempted and nothing is swapped out,
new requests from the waiting queue in arrival order, as long as their tokens fit the step's
budget and their blocks fit the free pool. When a running request needs a block and none is free,
the most recently arrived running request is preempted whole (all its sequences): its blocks are
swapped to the CPU pool (`preemption_mode` "swap", or "auto" when cheaper) or freed, and it goes
back to the front of the waiting queue to be recomputed.

After the model ran, `update_from_output` applies the step: computed tokens, prefix-cache
registration, forks, appended tokens, token-level stops (EOS, stop token ids, lengths), beam
steps, finishes and frees. The engine plugs text-level work (detokenizing, stop strings, logprob
formatting) in through a `StepObserver`.

Progress guarantee (see README "Preemption"): the oldest running request is never a victim
unless it is alone, and a request alone in the cache that still cannot grow finishes with
"length"; a group may compute any subset of its sequences in a step (being resident stays
all-or-nothing), so a group being recomputed always fits the token budget; a swapped group that
could not come back even into an empty cache is recomputed instead. Requests that can never be
admitted are rejected by the engine (`LLMEngine.add_request`) before they are queued.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.core.kv_cache_manager import BlockTable, KVCacheManager, cdiv
from pagedserve.core.step_update import StepObserver, StepUpdate, apply_step
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step, and how preempted requests are recovered. The defaults are the
    engine's (`EngineArgs`) for a model of 2048 positions.

    `preemption_mode="auto"` swaps a group when the estimated swap time (out and back in:
    `2 * blocks * swap_seconds_per_block`) is below the estimated recompute time
    (`tokens * recompute_seconds_per_token`); the engine derives both figures from the model and
    the device. Every mode falls back to recomputation when the CPU pool is full.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    swap_seconds_per_block: float = 0.0
    recompute_seconds_per_token: float = 0.0
    # Token ids that end a sequence (unless its request sets ignore_eos).
    eos_token_ids: tuple[int, ...] = ()

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
    # cpu), swap in (cpu -> device), then copy-on-write copies. This is correct by construction:
    # a victim is taken out of the step with every allocation made for it undone (so no pending
    # copy-on-write ever targets a block being swapped out, and its blocks all hold computed
    # K/V); a block freed by a swap-out may be handed to another sequence in the same step, and
    # its contents are saved first; copy sources may be blocks swapped in this step.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Requests that ended since the last step: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Sequences that left their (unfinished) request since the last step: pruned beams.
    freed_seq_ids: list[int] = field(default_factory=list)
    # Groups that could not grow even alone in the cache: finished with "length" this step.
    length_capped: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# (sequence, first token, end) of each sequence a group computes this step.
Plan = list[tuple[Sequence, int, int]]


class Scheduler:
    """FCFS continuous-batching scheduler over a `KVCacheManager`; see the module docstring.

    Queues: `waiting` (new, and preempted-by-recomputation at the front), `running` (sorted by
    arrival), `swapped` (preempted by swapping, sorted by arrival). `new_seq_id` hands out ids
    for the sequences beam search forks.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 new_seq_id: Callable[[], int] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._finished_ids: list[str] = []
        self._freed_seq_ids: list[int] = []
        self.num_preemptions = 0
        self.preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.new_seq_id = new_seq_id or _counter(1 << 40)

    # --- queue management --------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request. Raises ValueError for a group that could never be admitted."""
        if group.max_width > self.config.max_num_seqs:
            raise ValueError(
                f"n/best_of/beam width {group.max_width} is more than max_num_seqs "
                f"({self.config.max_num_seqs}): the request could never be scheduled")
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
        return sum(g.max_width_left for g in self.running)

    def _release(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
        self._finished_ids.append(group.request_id)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless the queues and the block tables agree: the KV manager's own
        checks, a request in one queue only, every unfinished sequence of a running group on the
        device (of a swapped group in the CPU pool, of a waiting group nowhere), finished
        sequences holding no blocks, and at most `max_num_seqs` running sequences."""
        self.kv.check_invariants()
        seen: set[str] = set()
        for queue, place in ((self.running, "device"), (self.swapped, "cpu"), (self.waiting, "")):
            for group in queue:
                if group.request_id in seen:
                    raise RuntimeError(f"request {group.request_id} is in two queues")
                seen.add(group.request_id)
                live = group.unfinished_seqs()
                for seq in group.seqs:
                    held = (seq.seq_id in self.kv.tables, seq.seq_id in self.kv.cpu_tables)
                    # A forking group's other sequences hold nothing until the fork.
                    holds = not (seq.is_finished or (group.fork_pending and seq is not live[0]))
                    expected = (holds and place == "device", holds and place == "cpu")
                    if held != expected:
                        raise RuntimeError(
                            f"request {group.request_id} ({place or 'waiting'}): sequence "
                            f"{seq.seq_id} holds device/cpu blocks {held}, expected {expected}")
        if self.num_running_seqs > self.config.max_num_seqs:
            raise RuntimeError(f"{self.num_running_seqs} running sequences > max_num_seqs")

    # --- after the step ----------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, results: list,
                           observer: StepObserver | None = None) -> StepUpdate:
        """Apply a step's results (one `SeqStepOutput` per scheduled sequence, in order): see
        `core.step_update.apply_step`."""
        return apply_step(self, sched, results, observer)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer a sequence's newly computed full blocks to the prefix cache."""
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                  seq.cache_salt)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks (shared, copy-on-write) and computed tokens."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = parent.status

    def drop_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Remove a pruned beam from its group and free its blocks."""
        self.kv.free(seq.seq_id)
        group.seqs.remove(seq)
        self._freed_seq_ids.append(seq.seq_id)

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

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens; allocate their blocks; preempt when the pool runs dry.

        Order: decode tokens of running requests first (so that a long prompt never stalls every
        stream), then prompt chunks of running requests, then swapped requests coming back, then
        new requests (only when nothing is swapped out and nothing was preempted this step).
        """
        out = SchedulerOutput(finished_request_ids=self._finished_ids,
                              freed_seq_ids=self._freed_seq_ids)
        self._finished_ids, self._freed_seq_ids = [], []
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
            need = self._blocks_to_swap_in(group, plan) if plan else 0
            if plan is not None and need > self.kv.num_blocks:
                # It could not come back even into an empty cache: recompute it instead.
                self.swapped.pop(0)
                self._requeue_for_recompute(group)
                continue
            if (plan is None or need > self.kv.num_free_blocks
                    or self.num_running_seqs + group.max_width_left > self.config.max_num_seqs):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.kv.swap_in(seq_ids))
            self._set_running(group)
            self._commit(plan, group, step, out)

        while self.waiting and not self.swapped and not out.preempted and step.budget > 0:
            group = self.waiting[0]
            if self.num_running_seqs + group.max_width_left > self.config.max_num_seqs:
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
            if group.num_cached_tokens is None:  # usage's cached_tokens: the first admission's
                group.num_cached_tokens = max((len(b) for _, b in hits), default=0) * (
                    self.kv.block_size)
            if self.kv.enable_prefix_caching:
                self.kv.prefix_queries += sum(self._lookup_len(group, seq) for seq, _, _ in plan)
            self.waiting.popleft()
            self._set_running(group)
            self._commit(plan, group, step, out)
        return out

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
        return hits

    @staticmethod
    def _lookup_len(group: SequenceGroup, seq: Sequence) -> int:
        """Tokens of `seq` looked up in the prefix cache (a forking parent's prompt only)."""
        return seq.num_prompt_tokens if group.fork_pending else seq.num_tokens

    def _blocks_to_admit(self, plan: Plan, hits: dict[int, list[int]]) -> int:
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

    def _schedule_running(self, group: SequenceGroup, step: "_Step", out: SchedulerOutput) -> None:
        plan = self._plan(group, step.budget)
        if plan is None:
            return
        while not self._fits(plan):
            victim = self.running[-1]
            if victim is group and len(self.running) == 1:
                # Alone in the cache: compute the sequences that still fit, else it can never grow.
                plan = self._fitting_prefix(plan)
                if plan:
                    break
                self.running.pop()
                for seq in group.unfinished_seqs():
                    self.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                self._release(group)
                out.length_capped.append(group)
                return
            self.running.pop()
            step.unschedule(victim, out, self.kv)
            self._preempt(victim, out)
            if victim is group:
                return
        self._commit(plan, group, step, out)

    def _blocks_to_swap_in(self, group: SequenceGroup, plan: Plan) -> int:
        """Device blocks a swapped group needs to come back and run `plan`: the distinct CPU
        blocks of all its sequences, the blocks its planned tokens fill, and one copy-on-write
        block per planned sequence (an upper bound)."""
        seq_ids = [seq.seq_id for seq in group.unfinished_seqs()]
        grow = sum(
            max(0, cdiv(end, self.kv.block_size) - len(self.kv.cpu_tables[seq.seq_id].blocks)) + 1
            for seq, _, end in plan
        )
        return self.kv.num_distinct_blocks(seq_ids, cpu=True) + grow

    def _is_decoding(self, group: SequenceGroup) -> bool:
        return all(s.num_tokens - s.num_computed_tokens == 1 for s in group.unfinished_seqs())

    def _set_running(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.RUNNING
        # NOTE: `running` stays sorted by arrival: the victim of a preemption is its last entry.
        bisect.insort(self.running, group, key=lambda g: g.arrival_time)

    def _plan(self, group: SequenceGroup, budget: int) -> Plan | None:
        """(seq, start, end) for the group's sequences that can compute within `budget`, or None
        if none can.

        NOTE: a group need not compute all its sequences in one step: after a recomputation each
        sequence recomputes its own output, and together they may exceed any token budget. Every
        sequence stays resident (blocks are all-or-nothing per group); the ones left out this
        step are taken in later steps.
        """
        chunked = self.config.enable_chunked_prefill
        plan: Plan = []
        seqs = group.unfinished_seqs()
        if group.fork_pending:
            seqs = seqs[:1]
        for seq in seqs:
            if budget <= 0:
                break
            start = seq.num_computed_tokens
            # A group that will fork computes the parent's prompt alone, then the others share it.
            stop = seq.num_prompt_tokens if group.fork_pending else seq.num_tokens
            want = stop - start
            if want <= 0:  # a beam waiting for its siblings' candidates: nothing to compute
                continue
            take = min(want, budget) if chunked else want
            if take > budget:  # without chunking a sequence computes whole: a later step
                continue
            plan.append((seq, start, start + take))
            budget -= take
        return plan or None

    def _fits(self, plan: Plan) -> bool:
        need = sum(self.kv.num_new_blocks(seq.seq_id, end) for seq, _, end in plan)
        return need <= self.kv.num_free_blocks

    def _fitting_prefix(self, plan: Plan) -> Plan:
        """The longest leading part of `plan` (whole sequences) whose new blocks are free."""
        free = self.kv.num_free_blocks
        kept: Plan = []
        for seq, start, end in plan:
            free -= self.kv.num_new_blocks(seq.seq_id, end)
            if free < 0:
                break
            kept.append((seq, start, end))
        return kept

    def _commit(self, plan: Plan, group: SequenceGroup, step: "_Step",
                out: SchedulerOutput) -> None:
        record = step.record_for(group)
        for seq, start, end in plan:
            record.snapshots.append((seq.seq_id, self.kv.snapshot(seq.seq_id)))
            copies = self.kv.allocate_slots(seq.seq_id, end)
            out.blocks_to_copy.extend(copies)
            record.copies.extend(copies)
            entry = ScheduledSequence.make(group, seq, start, end, self.kv.block_table(seq.seq_id))
            out.scheduled.append(entry)
            record.entries.append(entry)
            record.tokens += end - start
            step.budget -= end - start

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
        self._requeue_for_recompute(group)
        self.preemptions_by_mode["recompute"] += 1

    def _requeue_for_recompute(self, group: SequenceGroup) -> None:
        """Drop a group's blocks (device and CPU) and put it at the front of the waiting queue;
        it prefills its prompt once again, forks, and each sequence recomputes its output."""
        for seq in group.unfinished_seqs():
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        # NOTE: prompt logprobs of a prompt cut short are computed again from its start.
        if not group.prompt_logprobs_done and group.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        # Recompute the shared prompt once again, then fork: the group needs no more blocks
        # than it held before.
        group.fork_pending = len(group.unfinished_seqs()) > 1
        self.waiting.appendleft(group)

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


def _counter(start: int) -> Callable[[], int]:
    state = [start]

    def next_id() -> int:
        state[0] += 1
        return state[0]

    return next_id


@dataclass
class _GroupRecord:
    """Everything a group's `_commit` changed in the step being scheduled."""

    tokens: int = 0
    snapshots: list[tuple[int, BlockTable | None]] = field(default_factory=list)
    entries: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class _Step:
    """Book-keeping of the step being scheduled, so that a victim that was already scheduled
    this step can be taken out again with every change made for it undone."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._records: dict[str, _GroupRecord] = {}

    def record_for(self, group: SequenceGroup) -> _GroupRecord:
        return self._records.setdefault(group.request_id, _GroupRecord())

    def unschedule(self, group: SequenceGroup, out: SchedulerOutput, kv: KVCacheManager) -> None:
        """Undo the group's part of this step: its scheduled rows, its copy-on-write copies, its
        token budget, and its block tables as they were before the step (blocks gained are
        released)."""
        record = self._records.pop(group.request_id, None)
        if record is None:
            return
        self.budget += record.tokens
        dropped = {id(e) for e in record.entries}
        out.scheduled = [s for s in out.scheduled if id(s) not in dropped]
        copies = set(record.copies)
        out.blocks_to_copy = [p for p in out.blocks_to_copy if p not in copies]
        for seq_id, snapshot in reversed(record.snapshots):
            kv.restore(seq_id, snapshot)
