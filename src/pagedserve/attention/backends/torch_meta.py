"""The torch backend's metadata: the common tensors plus host-side groups of the step's rows.

`TorchAttentionMetadata.groups` holds the decode group (every decode row's query tokens, attended
as one batch: the compiled decode kernel, or each row over its gathered K/V) and the prompt group
(prompt chunks, attended chunk by chunk through their host-side `spans`). The Triton kernels read
the common tensors directly and build none of this (`triton_attn.TritonAttentionMetadata`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.attention.metadata import AttentionMetadata, StepLayout


@dataclass
class AttentionGroup:
    """The decode rows of a step (one query token per entry: a decode row of several tokens is
    one entry per token), or its prompt chunks.

    The decode group is attended as one batch (the compiled kernel, or SDPA over gathered K/V);
    the prompt group chunk by chunk through its host-side `spans`.
    """

    # NOTE: all index tensors live on the model's device and are built once per step, then shared
    # by every layer; nothing here may depend on the layer.
    seq_lens: torch.Tensor  # [G] int64
    block_tables: torch.Tensor  # [G, max_blocks] int64: the members' block tables
    block_size: int
    null_block: int
    max_len: int  # host copy of max(seq_lens)
    # Decode groups: the flat token row of each member's query (None in prompt groups).
    out_tokens: torch.Tensor | None = None  # [G] int64
    # True when the group's queries are the whole flat batch in order (out_tokens == 0..T-1):
    # a decode-only step, whose attention output needs no scatter.
    covers_all: bool = False
    # Prompt groups: (flat start, query length, context length) of each member, on the host, for
    # attending member by member, unpadded (None in decode groups).
    spans: list[tuple[int, int, int]] | None = None
    _kv_slots: torch.Tensor | None = None

    @property
    def is_prompt(self) -> bool:
        return self.spans is not None

    def _key_pos(self) -> torch.Tensor:  # [1, L] int64: 0..L-1
        return torch.arange(self.max_len, dtype=torch.int64, device=self.seq_lens.device).view(1, -1)

    @property
    def kv_slots(self) -> torch.Tensor:  # [G, L] int64
        """Cache slot of each context position of each member (padding -> the null block), for
        gathering K/V. NOTE: built on first use: the compiled decode kernel reads the block
        tables instead, and a decode step then never needs it."""
        if self._kv_slots is None:
            bt, key_pos, bs = self.block_tables, self._key_pos(), self.block_size
            blk_idx = (key_pos // bs).clamp(max=bt.shape[1] - 1).expand(bt.shape[0], -1)
            slots = torch.gather(bt, 1, blk_idx) * bs + key_pos % bs  # [G, L]
            self._kv_slots = torch.where(key_pos < self.seq_lens.unsqueeze(1), slots,
                                         torch.full_like(slots, self.null_block * bs))
        return self._kv_slots


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The torch backend's metadata (`TorchAttentionBackend.build_metadata`): the common tensors
    and `groups`, the decode group first (when the step has decode rows), then the prompt group
    (when it has prompt chunks)."""

    groups: list[AttentionGroup] = field(default_factory=list)

    def _add_backend_fields(self, step: StepLayout) -> None:
        self.groups = _decode_only_groups(self, step) if step.decode_only else _mixed_groups(step)


def _decode_only_groups(meta: TorchAttentionMetadata, step: StepLayout) -> list[AttentionGroup]:
    """The one group of a decode-only step, covering the whole batch in order: the step's tables
    and lengths as they are (rows of one token), or one entry per token (rows of several)."""
    device = step.device
    ar = torch.arange(meta.num_tokens, dtype=torch.int64, device=device)  # [T]
    if step.token_seqs is None:
        g_bt, g_sl = step.block_tables, step.seq_lens_t  # [T, max_blocks], [T]
    else:
        g_bt = step.block_tables[torch.tensor(step.token_seqs, device=device)]  # [T, max_blocks]
        g_sl = torch.tensor(step.token_lens, dtype=torch.int64, device=device)  # [T]
    return [AttentionGroup(seq_lens=g_sl, block_tables=g_bt, block_size=step.block_size,
                           null_block=step.null_block, max_len=meta.max_seq_len, out_tokens=ar,
                           covers_all=True)]


def _mixed_groups(step: StepLayout) -> list[AttentionGroup]:
    """The decode group (if any row decodes) and the prompt group (if any row is a prompt chunk)
    of a mixed step, from its host tensors."""
    groups = []
    decode_rows = step.decode_rows
    if decode_rows is None:
        decode_rows = [n == 1 for n in step.query_lens]
    starts = step.query_start_loc.tolist()
    if any(decode_rows):
        groups.append(_decode_group(decode_rows, starts, step))
    prompt = [i for i, d in enumerate(decode_rows) if not d]
    if prompt:
        groups.append(_group(torch.tensor(prompt), step.block_tables, step.seq_lens_t,
                             step.block_size, step.null_block, step.device,
                             spans=[(starts[i], step.query_lens[i], step.seq_lens[i])
                                    for i in prompt]))
    return groups


def _group(members: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor, block_size: int, null_block: int,
           device, *, out_tokens: torch.Tensor | None = None,
           spans: list[tuple[int, int, int]] | None = None) -> AttentionGroup:
    """The group of sequences `members` (indices into the step's sequences)."""
    g_sl = sl[members]  # [G]
    return AttentionGroup(seq_lens=g_sl.to(device), block_tables=bt[members].to(device),
                          block_size=block_size, null_block=null_block, max_len=int(g_sl.max()),
                          out_tokens=out_tokens, spans=spans)


def _decode_group(decode_rows: list[bool], starts: list[int], step: StepLayout) -> AttentionGroup:
    """The decode group of a mixed step: one entry per token of every decode row (a row of q
    tokens: token t over its first `seq_len - q + 1 + t` positions, see `AttentionMetadata.build`)."""
    rows, lens, out = [], [], []
    for i, is_decode in enumerate(decode_rows):
        if not is_decode:
            continue
        q, length = step.query_lens[i], step.seq_lens[i]
        for t in range(q):
            rows.append(i)
            lens.append(length - q + 1 + t)
            out.append(starts[i] + t)
    device = step.device
    return AttentionGroup(seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
                          block_tables=step.block_tables[torch.tensor(rows)].to(device),
                          block_size=step.block_size, null_block=step.null_block,
                          max_len=max(lens),
                          out_tokens=torch.tensor(out, dtype=torch.int64, device=device))
