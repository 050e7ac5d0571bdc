"""What travels from the driver to the tensor-parallel workers each step, and the mirrors that keep
it small.

The driver's `StepEncoder` turns a `SchedulerOutput` into a `StepMessage` holding only what
changed since the previous step: requests and sequences the workers have not seen (sampling
parameters travel once per request), the tokens each scheduled sequence gained (one per decode
step), the entries of its block table that changed (a new block every `block_size` tokens, a
copy-on-write target, a whole new table after swap-in or recomputation), the freed sequences and
finished requests, and the step's swap / copy block lists. Each worker's `StepDecoder` applies it
to its mirror and rebuilds the `SchedulerOutput` its `ModelRunner` reads, with the same
`ScheduledSequence` / `SequenceGroup` / `Sequence` types the scheduler made.

NOTE: both mirrors must see every message, in order; `reset()` both when the KV cache is rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.engine.beam_search import BeamSearchParams, BeamState
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup

DO_SAMPLE = 1
PROMPT_LOGPROBS = 2

# (seq_id, keep, appended): the list becomes `list[:keep] + appended`.
Delta = tuple[int, int, list[int]]


@dataclass
class StepMessage:
    """One step's input for every worker, as plain picklable data (see the module docstring)."""

    new_requests: list[tuple[str, SamplingParams, BeamSearchParams | None]] = field(default_factory=list)
    new_seqs: list[tuple[int, str, int]] = field(default_factory=list)  # (seq, request, prompt len)
    tokens: list[Delta] = field(default_factory=list)
    tables: list[Delta] = field(default_factory=list)
    # One per scheduled sequence, in batch order: (seq_id, start, end, flags, num_samples).
    rows: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # For a row that samples every sequence of a forking group: (row seq_id, those seq ids).
    forks: list[tuple[int, list[int]]] = field(default_factory=list)
    freed_seqs: list[int] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the step's GrammarBitmask (keyed by sequence id), or None.
    grammar_bitmask: object | None = None


class StepEncoder:
    """The driver's side: remembers what the workers hold and encodes each step as a delta."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything (the workers' mirrors are reset at the same time)."""
        self._seqs_of: dict[str, set[int]] = {}  # request id -> seq ids the workers hold
        self._num_tokens: dict[int, int] = {}  # seq id -> tokens the workers hold
        self._tables: dict[int, list[int]] = {}  # seq id -> block table as the workers hold it

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        """The message for this step; updates the remembered worker state."""
        msg = StepMessage(
            blocks_to_swap_out=sched.blocks_to_swap_out,
            blocks_to_swap_in=sched.blocks_to_swap_in,
            blocks_to_copy=sched.blocks_to_copy,
            grammar_bitmask=sched.grammar_bitmask,
        )
        for request_id in sched.finished_request_ids:
            held = self._seqs_of.pop(request_id, None)
            if held is not None:
                msg.finished_requests.append(request_id)
                for seq_id in held:
                    self._forget(seq_id)
        visited: set[str] = set()
        for s in sched.scheduled:
            group = s.group
            request_id = group.request_id
            held = self._seqs_of.get(request_id)
            if held is None:
                held = self._seqs_of[request_id] = set()
                beam = group.beam.params if group.beam is not None else None
                msg.new_requests.append((request_id, group.sampling_params, beam))
            elif request_id not in visited and held:
                # Sequences that left the group (pruned beams) since the workers last saw it.
                for seq_id in held.difference(q.seq_id for q in group.seqs):
                    held.discard(seq_id)
                    self._forget(seq_id)
                    msg.freed_seqs.append(seq_id)
            visited.add(request_id)
            forking = s.num_samples > 1
            samples = group.seqs[: s.num_samples] if forking else []
            for seq in (s.seq, *samples):
                self._sync_tokens(seq, request_id, held, msg)
            self._sync_table(s.seq.seq_id, s.block_table, msg)
            flags = (DO_SAMPLE if s.do_sample else 0) | (PROMPT_LOGPROBS if s.wants_prompt_logprobs else 0)
            msg.rows.append((s.seq.seq_id, s.start, s.end, flags, s.num_samples))
            if forking:
                msg.forks.append((s.seq.seq_id, [q.seq_id for q in samples]))
        return msg

    def _forget(self, seq_id: int) -> None:
        self._num_tokens.pop(seq_id, None)
        self._tables.pop(seq_id, None)

    def _sync_tokens(self, seq: Sequence, request_id: str, held: set[int], msg: StepMessage) -> None:
        sent = self._num_tokens.get(seq.seq_id)
        if sent is None:
            msg.new_seqs.append((seq.seq_id, request_id, seq.num_prompt_tokens))
            held.add(seq.seq_id)
            sent = 0
        n = len(seq.token_ids)
        if n != sent:
            # NOTE: a sequence's tokens only grow (`Sequence.token_ids` is append-only); a
            # shorter list than the workers hold would be resent whole.
            keep = sent if n > sent else 0
            msg.tokens.append((seq.seq_id, keep, seq.token_ids[keep:]))
            self._num_tokens[seq.seq_id] = n

    def _sync_table(self, seq_id: int, table: list[int], msg: StepMessage) -> None:
        old = self._tables.get(seq_id)
        if old is None:
            msg.tables.append((seq_id, 0, list(table)))
            self._tables[seq_id] = list(table)
            return
        if old == table:
            return
        keep = len(old) if table[: len(old)] == old else _common_prefix(old, table)
        msg.tables.append((seq_id, keep, table[keep:]))
        del old[keep:]
        old.extend(table[keep:])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StepDecoder:
    """A worker's side: the mirror of requests, sequences and block tables, and the
    `SchedulerOutput` rebuilt from each message."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.groups: dict[str, SequenceGroup] = {}
        self.seqs: dict[int, Sequence] = {}
        self.tables: dict[int, list[int]] = {}
        self._request_of: dict[int, str] = {}
        self._seqs_of: dict[str, set[int]] = {}

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        """Apply `msg` to the mirror; return the step as the runner reads it."""
        for request_id in msg.finished_requests:
            self.groups.pop(request_id, None)
            for seq_id in self._seqs_of.pop(request_id, ()):
                self._drop(seq_id)
        for seq_id in msg.freed_seqs:
            self._seqs_of[self._request_of[seq_id]].discard(seq_id)
            self._drop(seq_id)
        for request_id, params, beam in msg.new_requests:
            group = SequenceGroup(request_id, [], params, arrival_time=0.0)
            if beam is not None:
                group.beam = BeamState(beam)
            self.groups[request_id] = group
            self._seqs_of[request_id] = set()
        for seq_id, request_id, num_prompt_tokens in msg.new_seqs:
            seq = Sequence(seq_id, [])
            seq.num_prompt_tokens = num_prompt_tokens
            self.seqs[seq_id] = seq
            self._request_of[seq_id] = request_id
            self._seqs_of[request_id].add(seq_id)
        for seq_id, keep, appended in msg.tokens:
            _apply(self.seqs[seq_id].token_ids, keep, appended)
        for seq_id, keep, appended in msg.tables:
            _apply(self.tables.setdefault(seq_id, []), keep, appended)
        forks = dict(msg.forks)
        scheduled = []
        for seq_id, start, end, flags, num_samples in msg.rows:
            group = self.groups[self._request_of[seq_id]]
            if num_samples > 1:
                group.seqs = [self.seqs[q] for q in forks[seq_id]]
            scheduled.append(ScheduledSequence(
                group, self.seqs[seq_id], start, end, self.tables[seq_id],
                do_sample=bool(flags & DO_SAMPLE), wants_prompt_logprobs=bool(flags & PROMPT_LOGPROBS),
                num_samples=num_samples,
            ))
        return SchedulerOutput(
            scheduled=scheduled,
            blocks_to_swap_out=msg.blocks_to_swap_out,
            blocks_to_swap_in=msg.blocks_to_swap_in,
            blocks_to_copy=msg.blocks_to_copy,
            finished_request_ids=msg.finished_requests,
            grammar_bitmask=msg.grammar_bitmask,
        )

    def _drop(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.tables.pop(seq_id, None)
        self._request_of.pop(seq_id, None)


def _apply(target: list[int], keep: int, appended: list[int]) -> None:
    del target[keep:]
    target.extend(appended)
