"""What travels from the driver to the tensor-parallel workers each step, and the mirrors that keep
it small.

The scheduler emits the step's delta itself (`core.step_delta.StepDelta`, built from marks the
core sets as it changes things, nothing compared): requests and sequences the workers have not
seen (sampling parameters travel once per request), the tokens each scheduled sequence gained
(one per decode step), the entries of its block table that changed (a new block every
`block_size` tokens, a copy-on-write target, a whole new table after swap-in or recomputation),
the freed sequences and finished requests. The driver's `StepEncoder` packs it, with each row's
span and flags and the step's swap / copy block lists, into a `StepMessage`; each worker's
`StepDecoder` applies it to its mirror (plain lists per sequence and request) and gives the same
`StepInput` the driver encoded. Every executor speaks it, the in-process one too
(`worker.executor.UniExecutor`).

The mirror is the worker's persistent input batch: one `StepRow` per sequence, kept from step to
step with its token list and block table (both updated in place by the deltas) and its sample
specs; a step only moves each scheduled row's span and flags, nothing is rebuilt.
`StepDecoder.mismatches` checks a mirror against the driver's rows (tests).

NOTE: the mirror must see every message, in order; it is reset with the KV cache, which happens
only with no request in flight (core/step_delta.py: the core's marks assume the mirror lives as
long as the sequences it holds).
NOTE: a decoded step's rows are the mirror's own objects: the runner reads them during the step
only (the next message changes them in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.step_delta import StepDelta
from pagedserve.core.step_input import SampleSpec, StepInput, StepRow
from pagedserve.pooling_params import PoolingSpec
from pagedserve.sampling_params import SamplingParams

DO_SAMPLE = 1
PROMPT_LOGPROBS = 2
NEED_LOGPROB = 4


@dataclass
class StepMessage:
    """One step's input for every worker, as plain picklable data (see the module docstring)."""

    # The scheduler's changes to the workers' mirrors, as it made them (core/step_delta.py)
    delta: StepDelta = field(default_factory=StepDelta)
    # One per row, in batch order: (seq_id, start, end, flags, seq ids sampled at its end; None
    # for the row's own sequence alone).
    rows: list[tuple[int, int, int, int, list[int] | None]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the step's GrammarBitmask (keyed by sequence id), or None.
    grammar_bitmask: object | None = None
    # Speculative decoding: the draft tokens of the rows that verify some, by sequence id.
    spec_tokens: dict[int, list[int]] = field(default_factory=dict)


class StepEncoder:
    """The driver's side: packs the scheduler's `StepDelta` and the rows' spans into a
    `StepMessage`. It remembers nothing: the core's marks say what the workers hold
    (core/step_delta.py)."""

    def encode(self, step: StepInput) -> StepMessage:
        """The message for this step. ValueError for a step without its scheduler's delta."""
        delta = step.delta
        if delta is None:
            raise ValueError("step.delta is None: a step sent to workers must come from "
                             "StepInput.from_schedule (the scheduler's StepDelta)")
        rows: list = []
        msg = StepMessage(delta, rows, step.blocks_to_swap_out, step.blocks_to_swap_in,
                          step.blocks_to_copy, step.grammar_bitmask)
        # NOTE (step cost): one tuple per scheduled row every step, nothing compared.
        append = rows.append
        for row in step.rows:
            seq_id = row.seq_id
            samples = row.samples
            if len(samples) == 1 and samples[0].seq_id == seq_id:
                sampled = None  # (its own sequence alone: see StepMessage.rows)
            else:
                sampled = [spec.seq_id for spec in samples]
            flags = ((DO_SAMPLE if row.do_sample else 0)
                     | (PROMPT_LOGPROBS if row.prompt_logprobs else 0)
                     | (NEED_LOGPROB if row.need_logprob else 0))
            append((seq_id, row.start, row.end, flags, sampled))
            if row.spec_token_ids:
                msg.spec_tokens[seq_id] = row.spec_token_ids
        return msg


@dataclass
class _MirrorSeq:
    request_id: str
    num_prompt_tokens: int
    index: int
    token_ids: list[int] = field(default_factory=list)


class StepDecoder:
    """A worker's side: the mirror of requests, sequences and block tables, and the `StepInput`
    rebuilt from each message."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: dict[str, tuple[SamplingParams, int]] = {}
        self.pooling: dict[str, PoolingSpec] = {}
        self.loras: dict[str, object] = {}
        self.seqs: dict[int, _MirrorSeq] = {}
        self.tables: dict[int, list[int]] = {}
        self._seqs_of: dict[str, set[int]] = {}
        # The persistent batch: seq id -> its StepRow, and the seq ids its samples were made for
        self.rows: dict[int, StepRow] = {}
        self._sampled: dict[int, list[int]] = {}

    def decode(self, msg: StepMessage) -> StepInput:
        """Apply `msg` to the mirror; return the step as the runner reads it."""
        delta = msg.delta
        for request_id in delta.finished_requests:
            self.requests.pop(request_id, None)
            self.pooling.pop(request_id, None)
            self.loras.pop(request_id, None)
            for seq_id in self._seqs_of.pop(request_id, ()):
                self._drop(seq_id)
        for seq_id in delta.freed_seqs:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self._seqs_of[seq.request_id].discard(seq_id)
                self._drop(seq_id)
        for request_id, params, beam_width in delta.new_requests:
            self.requests[request_id] = (params, beam_width)
            self._seqs_of[request_id] = set()
        self.pooling.update(delta.new_pooling)
        self.loras.update(delta.new_loras)
        for seq_id, request_id, num_prompt_tokens, index in delta.new_seqs:
            self.seqs[seq_id] = _MirrorSeq(request_id, num_prompt_tokens, index)
            self._seqs_of[request_id].add(seq_id)
        seqs = self.seqs
        for seq_id, keep, appended in delta.tokens:
            target = seqs[seq_id].token_ids
            if keep == len(target):  # (_apply: the common delta, tokens appended)
                target += appended
            else:
                _apply(target, keep, appended)
        for seq_id, keep, appended in delta.tables:
            _apply(self.tables.setdefault(seq_id, []), keep, appended)
        rows = []
        mirror_rows, spec_tokens = self.rows, msg.spec_tokens
        for seq_id, start, end, flags, sampled in msg.rows:
            row = mirror_rows.get(seq_id)
            if row is None:
                row = mirror_rows[seq_id] = self._new_row(seq_id)
            row.start, row.end = start, end
            row.do_sample = flags & DO_SAMPLE != 0
            row.prompt_logprobs = flags & PROMPT_LOGPROBS != 0
            row.need_logprob = flags & NEED_LOGPROB != 0
            if spec_tokens:
                row.spec_token_ids = spec_tokens.get(seq_id, [])
            elif row.spec_token_ids:  # (no new empty list per row and step)
                row.spec_token_ids = []
            if self._sampled.get(seq_id, ()) != sampled:
                self._sampled[seq_id] = sampled
                specs = []
                for q in (seq_id,) if sampled is None else sampled:
                    other = self.seqs[q]
                    specs.append(SampleSpec(q, other.index, other.token_ids, other.num_prompt_tokens))
                row.samples = specs
            rows.append(row)
        # (the delta as it came: a step decoded here can be sent on, e.g. by a test's loopback)
        return StepInput(rows, msg.blocks_to_swap_out, msg.blocks_to_swap_in, msg.blocks_to_copy,
                         delta.finished_requests, delta.freed_seqs, msg.grammar_bitmask, delta)

    def mismatches(self, step: StepInput) -> list[str]:
        """Debug check (tests): where this mirror, having decoded `step`'s message, differs from
        the driver's rows of `step` (token lists, block tables, sampled sequences' tokens): []
        when it holds exactly the scheduler's state for every scheduled sequence."""
        found = []
        for row in step.rows:
            seq_id = row.seq_id
            seq = self.seqs.get(seq_id)
            if seq is None:
                found.append(f"sequence {seq_id}: not in the mirror")
                continue
            if seq.token_ids != row.token_ids:
                found.append(f"sequence {seq_id}: tokens {seq.token_ids} != {row.token_ids}")
            table = self.tables.get(seq_id)
            if table != row.block_table:
                found.append(f"sequence {seq_id}: block table {table} != {row.block_table}")
            for spec in row.samples:
                other = self.seqs.get(spec.seq_id)
                if other is None or other.token_ids != spec.token_ids:
                    found.append(f"sequence {spec.seq_id} (sampled by {seq_id}): tokens differ")
        return found

    def _new_row(self, seq_id: int) -> StepRow:
        """The sequence's row of the persistent batch: its mirror token list and block table."""
        seq = self.seqs[seq_id]
        params, beam_width = self.requests[seq.request_id]
        return StepRow(
            request_id=seq.request_id, seq_id=seq_id, token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens, start=0, end=0,
            block_table=self.tables[seq_id], params=params, beam_width=beam_width,
            pooling=self.pooling.get(seq.request_id), lora_request=self.loras.get(seq.request_id))

    def _drop(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.tables.pop(seq_id, None)
        self.rows.pop(seq_id, None)
        self._sampled.pop(seq_id, None)


def _apply(target: list[int], keep: int, appended: list[int]) -> None:
    del target[keep:]
    target.extend(appended)
