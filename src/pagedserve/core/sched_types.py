"""What the scheduler is configured with and what one step hands the model runner: the
scheduler's configuration, the scheduled rows, the step's output, and the book-keeping that lets a
step undo what it did for a victim. Pure Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.step_delta import StepDelta
from pagedserve.sequence import Sequence, SequenceGroup


PREEMPTION_MODES = ("recompute", "swap", "auto")
# fcfs: requests are served in arrival order; priority: by `priority` (lower first), then arrival.
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step, and how preempted requests are recovered. The defaults are the
    engine's (`EngineArgs`) for a model of 2048 positions.

    `preemption_mode="auto"` swaps a group when the estimated swap time (out and back in:
    `2 * blocks * swap_seconds_per_block`) is below the estimated recompute time
    (`tokens * recompute_seconds_per_token`); the engine derives both figures from the model and
    the device. Every mode falls back to recomputation when the CPU pool is full.

    `scheduling_policy="priority"` orders every queue by (request priority, arrival): a lower
    value is admitted first and preempted last; "fcfs" orders by arrival alone.
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
    scheduling_policy: str = "fcfs"
    # Distinct LoRA adapters running at once (enable_lora: max_loras); 0: no adapters, no limit.
    max_loras: int = 0
    # With chunked prefill, the most prompt tokens of one sequence in a step (0: no limit)
    long_prefill_token_threshold: int = 0
    # With chunked prefill, the step's prompt budget grows with its decode rows: this many
    # tokens a row, at least 24 times as many, at least the next prompt's remaining tokens; the
    # step's at most max_num_batched_tokens (core.step_budget.step_budget). 0: always the latter.
    prompt_budget_per_decode_row: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_budget_per_decode_row < 0:
            raise ValueError("prompt_budget_per_decode_row must be >= 0, got "
                             f"{self.prompt_budget_per_decode_row}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
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
    # Speculative decoding: the draft tokens this row verifies, after the sequence's last token
    # (`end` counts them: `end - len(spec_token_ids) == seq.num_tokens`); see core/spec_decode.py.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @classmethod
    def make(cls, group: SequenceGroup, seq: Sequence, start: int, end: int, table: list[int]):
        wants = (
            start < seq.num_prompt_tokens
            and group.sampling_params.prompt_logprobs is not None
            and not group.prompt_logprobs_done
            and seq is group.seqs[0]
        )
        num_tokens = seq.num_tokens
        do_sample = end >= num_tokens
        forking = do_sample and group.fork_pending and group.beam is None
        forks = len(group.unfinished_seqs()) if forking else 1
        if end > num_tokens:  # lookahead slots: the draft tokens (speculative decoding)
            return cls(group, seq, start, end, table, do_sample, wants, forks,
                       seq.spec_token_ids[: end - num_tokens])
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
    # What the workers' mirrors must change this step (core/step_delta.py), set by `schedule`.
    delta: StepDelta | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# (sequence, first token, end) of each sequence a group computes this step.
Plan = list[tuple[Sequence, int, int]]


class GroupRecord:
    """Everything a group's `_commit` changed in the step being scheduled: its tokens, its
    sequences' block-table snapshots (before the step), its rows and its copy-on-write copies.

    NOTE (step cost): one per scheduled group every step: a plain slotted class (a third of a
    dataclass's construction cost with list factories).
    """

    __slots__ = ("tokens", "snapshots", "entries", "copies")

    def __init__(self) -> None:
        self.tokens = 0
        self.snapshots: list[tuple[int, tuple[int, int, int, int] | None]] = []
        self.entries: list[ScheduledSequence] = []
        self.copies: list[tuple[int, int]] = []


class StepPlan:
    """Book-keeping of the step being scheduled, so that a victim that was already scheduled
    this step can be taken out again with every change made for it undone."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._records: dict[str, GroupRecord] = {}
        # The queue key of the first running group with sequences waiting their turn (None:
        # none): no new request is admitted behind it (under fcfs, none at all).
        self.turns_key: tuple | None = None
        # The rows and copy-on-write pairs of unscheduled groups (by identity: each is its own
        # object while the step holds it), taken out of the step's lists once, in `finish`.
        self._dropped: set[int] = set()
        self._dropped_copies: set[int] = set()

    def note_turns(self, key: tuple) -> None:
        if self.turns_key is None or key < self.turns_key:
            self.turns_key = key

    def record_one(self, group: SequenceGroup, seq_id: int, snapshot, entry: ScheduledSequence,
                   copies: list[tuple[int, int]]) -> None:
        """Record a group committed with one row of one token (`Scheduler._decode_one`): what
        `record_for` and `_commit` record for it, built at once. NOTE: the group has no record
        in this step yet (it is committed once per step)."""
        # NOTE (step cost): a tuple (entry, snapshot, copies), not a `GroupRecord` (one object,
        # not six, per row and step); `unschedule` and `record_for` take either.
        self._records[group.request_id] = (entry, snapshot, copies)
        self.budget -= 1

    def record_for(self, group: SequenceGroup) -> GroupRecord:
        record = self._records.get(group.request_id)
        if record is None:
            record = self._records[group.request_id] = GroupRecord()
        elif type(record) is tuple:  # (record_one's)
            record = self._records[group.request_id] = _full_record(record)
        return record

    def unschedule(self, group: SequenceGroup, out: SchedulerOutput, kv: KVCacheManager) -> bool:
        """Undo the group's part of this step: its scheduled rows, its copy-on-write copies, its
        token budget, and its block tables as they were before the step (blocks gained are
        released). Returns whether the group had been scheduled in this step."""
        record = self._records.pop(group.request_id, None)
        if record is None:
            return False
        if type(record) is tuple:  # (record_one's)
            record = _full_record(record)
        self.budget += record.tokens
        # NOTE (step cost): the rows are taken out of `out` in `finish`, in one pass however many
        # groups are unscheduled (a pass per victim made a step of many victims quadratic).
        self._dropped.update(id(e) for e in record.entries)
        self._dropped_copies.update(id(p) for p in record.copies)
        for seq_id, snapshot in reversed(record.snapshots):
            kv.restore(seq_id, snapshot)
        return True

    def finish(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step's output without the rows and copies of the groups unscheduled in it."""
        if self._dropped:
            out.scheduled = [s for s in out.scheduled if id(s) not in self._dropped]
        if self._dropped_copies:
            out.blocks_to_copy = [p for p in out.blocks_to_copy
                                  if id(p) not in self._dropped_copies]
        return out


def _full_record(one: tuple) -> GroupRecord:
    """The `GroupRecord` of a `StepPlan.record_one` tuple."""
    entry, snapshot, copies = one
    record = GroupRecord()
    record.tokens = entry.end - entry.start
    record.snapshots.append((entry.seq.seq_id, snapshot))
    record.entries.append(entry)
    record.copies.extend(copies)
    return record
