"""What the workers' mirrors must change this step: the scheduler emits it (`StepDelta`). Pure
Python, no torch.

The workers keep a mirror of every sequence they have run (its token list and block table) and
of every request (its sampling parameters); each step brings only what changed since they last
saw a sequence, as vLLM v1's scheduler output does: the requests and sequences new to them, the
tokens each scheduled sequence gained, the entries of its block table that changed, the
sequences freed (pruned beams) and the requests finished. Nothing is compared: the core marks
what it changes as it changes it, and `take_delta` reads the marks of the step's rows.

The marks:
- `SequenceGroup.sent`: the workers hold the request (its parameters travelled).
- `Sequence.sent_tokens`: the tokens the workers hold (-1: they do not know the sequence). A
  token list only grows (`Sequence.token_ids` is append-only), so the delta is the tail; a list
  shorter than what they hold is cut back (`keep` = its length).
- `BlockTable.synced` / `BlockTable.sent_len` (core/kv_cache_manager.py): the leading entries
  the workers hold unchanged, and how many they hold. Appending a block changes neither; a
  copy-on-write replacement, a sliding window's null entry or a truncation (rejected drafts'
  slots) lowers `synced` to the first entry it changed ("replace from index i"); a new table
  (first allocation, prefix hit, fork, swap-in, recomputation, a parked sequence's turn) starts
  at 0: it travels whole.

NOTE: a sequence's marks move only when a row of it is in the step (the workers read only the
scheduled rows); an unscheduled one keeps its marks until it is scheduled again. The marks
describe the workers' mirrors, which are reset only with the KV cache (`LLM.sleep`, with no
request in flight): no sequence outlives a reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.pooling_params import PoolingSpec
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.core.kv_cache_manager import BlockTable, KVCacheManager
    from pagedserve.sequence import Sequence

# (seq_id, keep, appended): the workers' list becomes `list[:keep] + appended`.
Delta = tuple[int, int, list[int]]


@dataclass
class StepDelta:
    """One step's changes to the workers' mirrors (see the module docstring). Plain data: the
    step message (`worker.step_message.StepMessage`) carries these lists as they are."""

    # (request id, sampling parameters, beam width or 0) of the requests new to the workers
    new_requests: list[tuple[str, SamplingParams, int]] = field(default_factory=list)
    # The pooling of the new requests that pool (runner="pooling"), by request id
    new_pooling: dict[str, PoolingSpec] = field(default_factory=dict)
    # The adapter (`lora.request.LoRARequest`) of the new requests that have one, by request id
    new_loras: dict[str, object] = field(default_factory=dict)
    # (seq id, request id, prompt length, sample index) of the sequences new to the workers
    new_seqs: list[tuple[int, str, int, int]] = field(default_factory=list)
    tokens: list[Delta] = field(default_factory=list)
    tables: list[Delta] = field(default_factory=list)
    # Sequences that left their request (pruned beams) and requests that ended, since the last
    # step: only those the workers hold.
    freed_seqs: list[int] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)


def _sync_tokens(seq: "Sequence", request_id: str, delta: StepDelta) -> None:
    """The tokens `seq` gained since the workers last saw it (the whole sequence, new)."""
    token_ids = seq.token_ids
    n = len(token_ids)
    sent = seq.sent_tokens
    if sent == n:
        return
    if sent < 0:
        delta.new_seqs.append((seq.seq_id, request_id, seq.num_prompt_tokens, seq.index))
        sent = 0
    elif sent > n:  # (never today: token lists only grow) cut back to what is left
        sent = n
    delta.tokens.append((seq.seq_id, sent, token_ids[sent:]))
    seq.sent_tokens = n


def take_delta(scheduled: list, kv: "KVCacheManager", delta: StepDelta) -> StepDelta:
    """Complete `delta` (the step's freed sequences and finished requests, already recorded)
    with what the step's rows (`SchedulerOutput.scheduled`: `ScheduledSequence`s) changed, and
    move their marks: the workers hold it once the step is sent. O(rows), each row O(1) plus
    what it sends.

    NOTE (step cost): one pass over the scheduled rows; the common row (a known sequence with
    one new token, its table unchanged) costs a few attribute reads."""
    tables = kv.tables
    new_seq = -1
    for s in scheduled:
        group, seq = s.group, s.seq
        if not group.sent:
            group.sent = True
            request_id = group.request_id
            beam = group.beam
            delta.new_requests.append((request_id, group.sampling_params,
                                       beam.params.beam_width if beam is not None else 0))
            if group.pooling is not None:
                delta.new_pooling[request_id] = group.pooling
            if group.lora_request is not None:
                delta.new_loras[request_id] = group.lora_request
        sent = seq.sent_tokens
        fresh = sent == new_seq
        if fresh or sent != len(seq.token_ids):
            _sync_tokens(seq, group.request_id, delta)
        if s.num_samples > 1:  # a forking row samples for its group's first sequences too
            for q in group.seqs[: s.num_samples]:
                if q is not seq:
                    _sync_tokens(q, group.request_id, delta)
        sync_table(seq.seq_id, tables[seq.seq_id], fresh, delta)
    return delta


def sync_table(seq_id: int, table: "BlockTable", fresh: bool, delta: StepDelta) -> None:
    """The entries of `seq_id`'s table that changed since the workers last saw it, if any (all
    of it for a sequence new to them, `fresh`): `(seq_id, keep, entries[keep:])`; the marks
    move. O(1) when nothing changed."""
    blocks = table.blocks
    n = len(blocks)
    if fresh:
        keep = 0
    else:
        keep = table.synced
        if keep == n and table.sent_len == n:
            return
    delta.tables.append((seq_id, keep, blocks[keep:]))
    table.synced = table.sent_len = n
