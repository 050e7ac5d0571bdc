"""What travels from the driver to the tensor-parallel workers each step, and the mirrors that keep
it small.

The driver's `StepEncoder` turns a `StepInput` into a `StepMessage` holding only what changed
since the previous step: requests and sequences the workers have not seen (sampling parameters
travel once per request), the tokens each sequence gained (one per decode step), the entries of
its block table that changed (a new block every `block_size` tokens, a copy-on-write target, a
whole new table after swap-in or recomputation), the freed sequences and finished requests, and
the step's swap / copy block lists. Each worker's `StepDecoder` applies it to its mirror (plain
lists per sequence and request) and gives the same `StepInput` the driver encoded. Every executor
speaks it, the in-process one too (`worker.executor.UniExecutor`).

The mirror is the worker's persistent input batch: one `StepRow` per sequence, kept from step to
step with its token list and block table (both updated in place by the deltas) and its sample
specs; a step only moves each scheduled row's span and flags, nothing is rebuilt.

NOTE: both mirrors must see every message, in order; `reset()` both when the KV cache is rebuilt.
NOTE: a decoded step's rows are the mirror's own objects: the runner reads them during the step
only (the next message changes them in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.step_input import SampleSpec, StepInput, StepRow
from pagedserve.pooling_params import PoolingSpec
from pagedserve.sampling_params import SamplingParams

DO_SAMPLE = 1
PROMPT_LOGPROBS = 2
NEED_LOGPROB = 4

# (seq_id, keep, appended): the list becomes `list[:keep] + appended`.
Delta = tuple[int, int, list[int]]


@dataclass
class StepMessage:
    """One step's input for every worker, as plain picklable data (see the module docstring)."""

    # (request id, sampling parameters, beam width or 0)
    new_requests: list[tuple[str, SamplingParams, int]] = field(default_factory=list)
    # The pooling of the new requests that pool (runner="pooling"), by request id
    new_pooling: dict[str, PoolingSpec] = field(default_factory=dict)
    # The adapter (`lora.request.LoRARequest`) of the new requests that have one, by request id
    new_loras: dict[str, object] = field(default_factory=dict)
    # (seq id, request id, prompt length, sample index)
    new_seqs: list[tuple[int, str, int, int]] = field(default_factory=list)
    tokens: list[Delta] = field(default_factory=list)
    tables: list[Delta] = field(default_factory=list)
    # One per row, in batch order: (seq_id, start, end, flags, seq ids sampled at its end; None
    # for the row's own sequence alone).
    rows: list[tuple[int, int, int, int, list[int] | None]] = field(default_factory=list)
    freed_seqs: list[int] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: the step's GrammarBitmask (keyed by sequence id), or None.
    grammar_bitmask: object | None = None
    # Speculative decoding: the draft tokens of the rows that verify some, by sequence id.
    spec_tokens: dict[int, list[int]] = field(default_factory=dict)


class StepEncoder:
    """The driver's side: remembers what the workers hold and encodes each step as a delta."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything (the workers' mirrors are reset at the same time)."""
        self._seqs_of: dict[str, set[int]] = {}  # request id -> seq ids the workers hold
        self._num_tokens: dict[int, int] = {}  # seq id -> tokens the workers hold
        self._tables: dict[int, list[int]] = {}  # seq id -> block table as the workers hold it

    def encode(self, step: StepInput) -> StepMessage:
        """The message for this step; updates the remembered worker state."""
        msg = StepMessage(
            blocks_to_swap_out=step.blocks_to_swap_out,
            blocks_to_swap_in=step.blocks_to_swap_in,
            blocks_to_copy=step.blocks_to_copy,
            grammar_bitmask=step.grammar_bitmask,
        )
        for request_id in step.finished_request_ids:
            held = self._seqs_of.pop(request_id, None)
            if held is not None:
                msg.finished_requests.append(request_id)
                for seq_id in held:
                    self._forget(seq_id)
        for seq_id in step.freed_seq_ids:
            if seq_id in self._num_tokens:
                for held in self._seqs_of.values():
                    held.discard(seq_id)
                self._forget(seq_id)
                msg.freed_seqs.append(seq_id)
        # NOTE (step cost): one row per scheduled sequence every step; the common row (a known
        # sequence that gained tokens, its table unchanged or grown by a block, its own one
        # sample) is encoded inline, the rest through `_sync_tokens` / `_sync_table`.
        seqs_of, num_tokens, tables = self._seqs_of, self._num_tokens, self._tables
        deltas, rows = msg.tokens, msg.rows
        for row in step.rows:
            seq_id = row.seq_id
            held = seqs_of.get(row.request_id)
            if held is None:
                held = seqs_of[row.request_id] = set()
                msg.new_requests.append((row.request_id, row.params, row.beam_width))
                if row.pooling is not None:
                    msg.new_pooling[row.request_id] = row.pooling
                if row.lora_request is not None:
                    msg.new_loras[row.request_id] = row.lora_request
            token_ids = row.token_ids
            sent = num_tokens.get(seq_id)
            n = len(token_ids)
            if sent is not None and n > sent:  # (_sync_tokens: the tokens it gained)
                deltas.append((seq_id, sent, token_ids[sent:]))
                num_tokens[seq_id] = n
            elif sent is None or n != sent:
                self._sync_tokens(seq_id, token_ids, row.num_prompt_tokens, 0, row.request_id,
                                  held, msg)
            samples = row.samples
            if len(samples) == 1 and samples[0].seq_id == seq_id:
                sampled = None  # (its own sequence alone: see StepMessage.rows)
            else:
                for spec in samples:
                    if spec.seq_id != seq_id:  # (the row's own sequence: just synced)
                        self._sync_tokens(spec.seq_id, spec.token_ids, spec.num_prompt_tokens,
                                          spec.index, row.request_id, held, msg)
                sampled = [spec.seq_id for spec in samples]
            table = row.block_table
            old = tables.get(seq_id)
            if old is None or old != table:
                self._sync_table(seq_id, table, msg)
            flags = ((DO_SAMPLE if row.do_sample else 0)
                     | (PROMPT_LOGPROBS if row.prompt_logprobs else 0)
                     | (NEED_LOGPROB if row.need_logprob else 0))
            rows.append((seq_id, row.start, row.end, flags, sampled))
            if row.spec_token_ids:
                msg.spec_tokens[seq_id] = row.spec_token_ids
        return msg

    def _forget(self, seq_id: int) -> None:
        self._num_tokens.pop(seq_id, None)
        self._tables.pop(seq_id, None)

    def _sync_tokens(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, index: int,
                     request_id: str, held: set[int], msg: StepMessage) -> None:
        sent = self._num_tokens.get(seq_id)
        if sent is None:
            msg.new_seqs.append((seq_id, request_id, num_prompt_tokens, index))
            held.add(seq_id)
            sent = 0
        n = len(token_ids)
        if n != sent:
            # NOTE: a sequence's tokens only grow (`Sequence.token_ids` is append-only); a
            # shorter list than the workers hold would be resent whole.
            keep = sent if n > sent else 0
            msg.tokens.append((seq_id, keep, token_ids[keep:]))
            self._num_tokens[seq_id] = n

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
        for request_id in msg.finished_requests:
            self.requests.pop(request_id, None)
            self.pooling.pop(request_id, None)
            self.loras.pop(request_id, None)
            for seq_id in self._seqs_of.pop(request_id, ()):
                self._drop(seq_id)
        for seq_id in msg.freed_seqs:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self._seqs_of[seq.request_id].discard(seq_id)
                self._drop(seq_id)
        for request_id, params, beam_width in msg.new_requests:
            self.requests[request_id] = (params, beam_width)
            self._seqs_of[request_id] = set()
        self.pooling.update(msg.new_pooling)
        self.loras.update(msg.new_loras)
        for seq_id, request_id, num_prompt_tokens, index in msg.new_seqs:
            self.seqs[seq_id] = _MirrorSeq(request_id, num_prompt_tokens, index)
            self._seqs_of[request_id].add(seq_id)
        seqs = self.seqs
        for seq_id, keep, appended in msg.tokens:
            target = seqs[seq_id].token_ids
            if keep == len(target):  # (_apply: the common delta, tokens appended)
                target += appended
            else:
                _apply(target, keep, appended)
        for seq_id, keep, appended in msg.tables:
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
        return StepInput(rows, msg.blocks_to_swap_out, msg.blocks_to_swap_in, msg.blocks_to_copy,
                         msg.finished_requests, msg.freed_seqs, msg.grammar_bitmask)

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
