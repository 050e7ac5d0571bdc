"""Attention metadata for one model step over a flat token batch.

The model runner builds one `AttentionMetadata` per step; every attention layer of the model reads
it. It says where each new token's K/V goes (`slot_mapping`) and, per sequence, which physical
blocks hold its context (`block_tables`) and how long that context is (`seq_lens`).

Tokens of the flat batch are ordered sequence by sequence: the query tokens of sequence `i` are
`query_start_loc[i] : query_start_loc[i + 1]`, and they are the *last* `query_len` positions of
that sequence's context of `seq_lens[i]` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BACKENDS = ("torch", "triton")


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
class AttentionMetadata:
    """Everything attention needs for one step; see the module docstring."""

    slot_mapping: torch.Tensor  # [T] int64: slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with the null block
    seq_lens: torch.Tensor  # [S] int64: context length after this step's tokens
    query_start_loc: torch.Tensor  # [S + 1] int64
    block_size: int
    num_tokens: int
    groups: list[AttentionGroup]  # torch backend only: empty when built without groups
    max_seq_len: int = 0  # host copy of max(seq_lens), for kernel grids and heuristics
    max_query_len: int = 0  # host copy of max(query lens)
    backend: str = "torch"  # "torch" | "triton": the attention backend the layers dispatch to
    num_splits: int | None = None  # triton split-K parts; None = its heuristic (fix it for CUDA graphs)
    # The `attention.backends.AttentionBackend` that built it (`build_metadata`) and runs it;
    # None when built here directly (`attention.backends.base.backend_of` then makes one).
    impl: object | None = None
    # Several KV groups: each model layer's metadata (its column's block tables and slots;
    # `AttentionBatch.width`), read by `models.base.DecoderStack`; None: every layer reads this.
    per_layer: list[AttentionMetadata] | None = None
    _token_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:  # [T, max_blocks], [T] int64
        """Every query token of the step as a decode row: its sequence's block table and its own
        context length (token j of a chunk of q tokens sees the first `seq_len - q + j + 1`
        positions). For kernels that attend each token alone (attention sinks on the decode
        kernel). NOTE: built on first use, then shared by every layer reading this metadata."""
        if self._token_rows is None:
            if self.max_query_len == 1:  # decode rows only: one token per sequence
                self._token_rows = (self.block_tables, self.seq_lens)
            else:
                qsl = self.query_start_loc
                counts = qsl[1:] - qsl[:-1]  # [S] tokens per sequence
                seq = torch.repeat_interleave(torch.arange(len(counts), device=qsl.device), counts)  # [T]
                pos = torch.arange(len(seq), device=qsl.device) - qsl[seq]  # [T] index in its chunk
                lens = self.seq_lens[seq] - counts[seq] + pos + 1  # [T]
                self._token_rows = (self.block_tables.index_select(0, seq), lens.contiguous())
        return self._token_rows

    @classmethod
    def build(
        cls,
        *,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        null_block: int,
        device: torch.device | str = "cpu",
        backend: str = "torch",
        build_groups: bool | None = None,
        num_splits: int | None = None,
        decode_rows: list[bool] | None = None,
    ) -> AttentionMetadata:
        """Build the metadata from host lists (one entry per sequence, in flat-batch order).

        `backend` ("torch" | "triton", already resolved: see `platforms.Platform.attention_backend`)
        picks what `PagedAttention` calls. `build_groups` (default: only for "torch") builds the
        per-group tensors the torch backend needs; the triton kernels read
        `block_tables` / `seq_lens` / `query_start_loc` directly, so they skip that host work.

        The slot of context position p of sequence i is
        `block_tables[i][p // block_size] * block_size + p % block_size`.

        NOTE: `null_block` is a block the pool never hands out and nobody writes (the worker keeps it
        zero). Padding of block tables and of gathered context points at it, so that masked-out
        keys read zeros, never stale or NaN contents of freed blocks (0 * NaN would poison softmax).

        `decode_rows` marks the decode rows (default: the rows of one token). A decode row of q > 1
        tokens (speculative decoding: the last token and its drafts) joins the decode group as q
        entries, token t attending over its own context (`seq_len - q + 1 + t` positions: causal
        within the row), so the compiled decode kernels (and the fused decoder layer, when every
        row is a decode row) take it as they take q one-token rows.
        """
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
        if build_groups is None:
            build_groups = backend == "torch"
        num_seqs = len(seq_lens)
        if not (len(block_tables) == len(query_lens) == num_seqs):
            raise ValueError("block_tables, seq_lens and query_lens must have one entry per sequence")
        if num_seqs and (all(decode_rows) if decode_rows is not None
                         else min(query_lens) == max(query_lens) == 1):
            return cls._build_decode(block_tables, seq_lens, block_size, null_block, device,
                                     backend, build_groups, num_splits,
                                     None if decode_rows is None else query_lens)
        max_blocks = max((len(t) for t in block_tables), default=0) or 1
        bt = torch.full((num_seqs, max_blocks), null_block, dtype=torch.int64)
        for i, table in enumerate(block_tables):
            if table:
                bt[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
        sl = torch.tensor(seq_lens, dtype=torch.int64)
        ql = torch.tensor(query_lens, dtype=torch.int64)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(ql, 0, out=qsl[1:])
        num_tokens = int(qsl[-1])

        # Slot of every new token: positions seq_len - query_len .. seq_len - 1 of each sequence.
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), ql)  # [T]
        pos_of_token = torch.arange(num_tokens) - qsl[:-1][seq_of_token] + (sl - ql)[seq_of_token]
        slot_mapping = (
            bt[seq_of_token, pos_of_token // block_size] * block_size + pos_of_token % block_size
        )

        groups = []
        if decode_rows is None:
            decode_rows = [n == 1 for n in query_lens]
        if build_groups:
            starts = qsl.tolist()
            if any(decode_rows):
                groups.append(_decode_group(decode_rows, starts, query_lens, seq_lens, bt,
                                            block_size, null_block, device))
            prompt = [i for i, d in enumerate(decode_rows) if not d]
            if prompt:
                groups.append(_group(torch.tensor(prompt), bt, sl, block_size, null_block, device,
                                     spans=[(starts[i], query_lens[i], seq_lens[i])
                                            for i in prompt]))
        return cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=bt.to(device),
            seq_lens=sl.to(device),
            query_start_loc=qsl.to(device),
            block_size=block_size,
            num_tokens=num_tokens,
            groups=groups,
            max_seq_len=int(sl.max()) if num_seqs else 0,
            max_query_len=int(ql.max()) if num_seqs else 0,
            backend=backend,
            num_splits=num_splits,
        )


    @classmethod
    def _build_decode(cls, block_tables, seq_lens, block_size, null_block, device, backend,
                      build_groups, num_splits, query_lens=None) -> AttentionMetadata:
        """`build` for a decode-only step (one query token per sequence, the usual step; or decode
        rows of several tokens, `query_lens`, see `build`): the same tensors from host lists in a
        few ops (each torch op costs microseconds of Python and a GIL round trip, next to a
        server's HTTP thread)."""
        n = len(seq_lens)
        max_blocks = max(len(t) for t in block_tables) or 1
        multi = query_lens is not None and max(query_lens) > 1
        padded, slots = [], []
        entry_rows, entry_lens = [], []  # multi: the decode group's entries, one per token
        for i, (table, length) in enumerate(zip(block_tables, seq_lens)):
            row = table + [null_block] * (max_blocks - len(table))
            padded.append(row)
            # the new token is position length - 1 (in padding: the null block, as below)
            if not 0 < length <= max_blocks * block_size:
                raise ValueError(f"seq_len {length} is not within its block table ({len(table)} "
                                 f"blocks of {block_size})")
            if not multi:
                blk = row[(length - 1) // block_size]
                slots.append(blk * block_size + (length - 1) % block_size)
                continue
            q = query_lens[i]
            for pos in range(length - q, length):
                slots.append(row[pos // block_size] * block_size + pos % block_size)
                entry_rows.append(i)
                entry_lens.append(pos + 1)
        bt = torch.tensor(padded, dtype=torch.int64, device=device)  # [S, max_blocks]
        sl = torch.tensor(seq_lens, dtype=torch.int64, device=device)  # [S]
        num_tokens = len(slots)
        if multi:
            qsl = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0, out=qsl[1:])
            qsl = qsl.to(device)
        else:
            qsl = torch.arange(n + 1, dtype=torch.int64, device=device)  # [S + 1]
        max_len = max(seq_lens)
        groups = []
        if build_groups:
            ar = torch.arange(num_tokens, dtype=torch.int64, device=device)
            g_bt = bt[torch.tensor(entry_rows, device=device)] if multi else bt  # [T, max_blocks]
            g_sl = torch.tensor(entry_lens, dtype=torch.int64, device=device) if multi else sl
            groups.append(AttentionGroup(seq_lens=g_sl, block_tables=g_bt, block_size=block_size,
                                         null_block=null_block, max_len=max_len, out_tokens=ar,
                                         covers_all=True))
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=bt, seq_lens=sl, query_start_loc=qsl, block_size=block_size,
            num_tokens=num_tokens, groups=groups, max_seq_len=max_len,
            max_query_len=max(query_lens) if multi else 1, backend=backend,
            num_splits=num_splits,
        )


def _group(members: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor, block_size: int, null_block: int,
           device, *, out_tokens: torch.Tensor | None = None,
           spans: list[tuple[int, int, int]] | None = None) -> AttentionGroup:
    """The group of sequences `members` (indices into the step's sequences)."""
    g_sl = sl[members]  # [G]
    return AttentionGroup(seq_lens=g_sl.to(device), block_tables=bt[members].to(device),
                          block_size=block_size, null_block=null_block, max_len=int(g_sl.max()),
                          out_tokens=out_tokens, spans=spans)


def _decode_group(decode_rows: list[bool], starts: list[int], query_lens: list[int],
                  seq_lens: list[int], bt: torch.Tensor, block_size: int, null_block: int,
                  device) -> AttentionGroup:
    """The decode group of a mixed step: one entry per token of every decode row (a row of q
    tokens: token t over its first `seq_len - q + 1 + t` positions, see `AttentionMetadata.build`)."""
    rows, lens, out = [], [], []
    for i, is_decode in enumerate(decode_rows):
        if not is_decode:
            continue
        q, length = query_lens[i], seq_lens[i]
        for t in range(q):
            rows.append(i)
            lens.append(length - q + 1 + t)
            out.append(starts[i] + t)
    return AttentionGroup(seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
                          block_tables=bt[torch.tensor(rows)].to(device), block_size=block_size,
                          null_block=null_block, max_len=max(lens),
                          out_tokens=torch.tensor(out, dtype=torch.int64, device=device))
