"""Attention metadata for one model step over a flat token batch: what every backend reads.

Each step's metadata is built by the step's attention backend (`attention.backends.base.
AttentionBackend.build_metadata`), as that backend's subclass of `AttentionMetadata` (its own
fields beside the common ones: the torch backend's host-side groups, `backends.torch_meta`; the
Triton backend's split-K count); every attention layer of the model reads it. It says where each
new token's K/V goes (`slot_mapping`) and, per sequence, which physical blocks hold its context
(`block_tables`) and how long that context is (`seq_lens`).

Tokens of the flat batch are ordered sequence by sequence: the query tokens of sequence `i` are
`query_start_loc[i] : query_start_loc[i + 1]`, and they are the *last* `query_len` positions of
that sequence's context of `seq_lens[i]` tokens.

NOTE: this module names no backend and imports none (the backends import it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepLayout:
    """The step as `AttentionMetadata.build` laid it out, handed to a subclass's
    `_add_backend_fields` so that a backend's own fields cost no second pass over the step.

    The tensors are the common fields' before they move to the device on a mixed step (host
    tensors), and the common fields themselves on a decode-only one (built on the device
    directly, `AttentionMetadata._build_decode`)."""

    seq_lens: list[int]  # [S] context lengths after the step
    query_lens: list[int]  # [S]
    # [S] which rows decode, as given to `build` (None: the rows of one token); on a decode-only
    # step every row does, and this is None
    decode_rows: list[bool] | None
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with the null block
    seq_lens_t: torch.Tensor  # [S] int64
    query_start_loc: torch.Tensor  # [S + 1] int64
    block_size: int
    null_block: int
    device: torch.device | str
    decode_only: bool  # every row decodes (`AttentionMetadata._build_decode`)
    # Decode-only steps with rows of several tokens: each token's sequence and its context
    # length (token t of a row of q over `seq_len - q + 1 + t` positions); None otherwise.
    token_seqs: list[int] | None = None
    token_lens: list[int] | None = None


@dataclass
class AttentionMetadata:
    """What every attention backend reads of one step; see the module docstring. A backend's
    subclass adds its own fields (`_add_backend_fields`); `impl` is the backend that built it
    and runs it."""

    slot_mapping: torch.Tensor  # [T] int64: slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with the null block
    seq_lens: torch.Tensor  # [S] int64: context length after this step's tokens
    query_start_loc: torch.Tensor  # [S + 1] int64
    block_size: int
    num_tokens: int
    max_seq_len: int = 0  # host copy of max(seq_lens), for kernel grids and heuristics
    max_query_len: int = 0  # host copy of max(query lens)
    # The `attention.backends.AttentionBackend` that built it (`build_metadata`) and runs it:
    # `layers.attention.PagedAttention` calls `meta.impl.forward`.
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

    def _add_backend_fields(self, step: StepLayout) -> None:
        """Set the fields a backend's subclass adds, from the step's layout; none here."""

    @classmethod
    def build(
        cls,
        *,
        impl: object,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        null_block: int,
        device: torch.device | str = "cpu",
        decode_rows: list[bool] | None = None,
    ) -> AttentionMetadata:
        """The metadata of `cls` (a backend's subclass) from host lists (one entry per sequence, in
        flat-batch order), run by `impl`: the common tensors here, the subclass's own fields by
        its `_add_backend_fields`. Called by `AttentionBackend.build_metadata`, the one way in.

        The slot of context position p of sequence i is
        `block_tables[i][p // block_size] * block_size + p % block_size`.

        NOTE: `null_block` is a block the pool never hands out and nobody writes (the worker keeps it
        zero). Padding of block tables and of gathered context points at it, so that masked-out
        keys read zeros, never stale or NaN contents of freed blocks (0 * NaN would poison softmax).

        `decode_rows` marks the decode rows (default: the rows of one token). A decode row of q > 1
        tokens (speculative decoding: the last token and its drafts) is q decode entries to the
        backends that group rows, token t attending over its own context (`seq_len - q + 1 + t`
        positions: causal within the row), so the compiled decode kernels (and the fused decoder
        layer, when every row is a decode row) take it as they take q one-token rows.
        """
        num_seqs = len(seq_lens)
        if not (len(block_tables) == len(query_lens) == num_seqs):
            raise ValueError("block_tables, seq_lens and query_lens must have one entry per sequence")
        if num_seqs and (all(decode_rows) if decode_rows is not None
                         else min(query_lens) == max(query_lens) == 1):
            return cls._build_decode(impl, block_tables, seq_lens, query_lens, block_size,
                                     null_block, device,
                                     decode_rows is not None and max(query_lens) > 1)
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
        )  # [T]
        meta = cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=bt.to(device),
            seq_lens=sl.to(device),
            query_start_loc=qsl.to(device),
            block_size=block_size,
            num_tokens=num_tokens,
            max_seq_len=int(sl.max()) if num_seqs else 0,
            max_query_len=int(ql.max()) if num_seqs else 0,
            impl=impl,
        )
        meta._add_backend_fields(StepLayout(
            seq_lens=seq_lens, query_lens=query_lens, decode_rows=decode_rows, block_tables=bt,
            seq_lens_t=sl, query_start_loc=qsl, block_size=block_size, null_block=null_block,
            device=device, decode_only=False))
        return meta

    @classmethod
    def _build_decode(cls, impl, block_tables, seq_lens, query_lens, block_size, null_block,
                      device, multi: bool) -> AttentionMetadata:
        """`build` for a decode-only step (one query token per sequence, the usual step; or, with
        `multi`, decode rows of several tokens, see `build`): the same tensors from host lists in a
        few ops (each torch op costs microseconds of Python and a GIL round trip, next to a
        server's HTTP thread)."""
        n = len(seq_lens)
        max_blocks = max(len(t) for t in block_tables) or 1
        padded, slots = [], []
        token_seqs, token_lens = [], []  # multi: each token's sequence and context length
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
                token_seqs.append(i)
                token_lens.append(pos + 1)
        bt = torch.tensor(padded, dtype=torch.int64, device=device)  # [S, max_blocks]
        sl = torch.tensor(seq_lens, dtype=torch.int64, device=device)  # [S]
        num_tokens = len(slots)
        if multi:
            qsl = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0, out=qsl[1:])
            qsl = qsl.to(device)
        else:
            qsl = torch.arange(n + 1, dtype=torch.int64, device=device)  # [S + 1]
        meta = cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),  # [T]
            block_tables=bt, seq_lens=sl, query_start_loc=qsl, block_size=block_size,
            num_tokens=num_tokens, max_seq_len=max(seq_lens),
            max_query_len=max(query_lens) if multi else 1, impl=impl,
        )
        meta._add_backend_fields(StepLayout(
            seq_lens=seq_lens, query_lens=query_lens, decode_rows=None, block_tables=bt,
            seq_lens_t=sl, query_start_loc=qsl, block_size=block_size, null_block=null_block,
            device=device, decode_only=True, token_seqs=token_seqs if multi else None,
            token_lens=token_lens if multi else None))
        return meta
