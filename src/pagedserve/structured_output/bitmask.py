"""The worker's side of structured outputs: the step's token bitmask as plain data, and its
application to the logits (xgrammar's batched CPU / CUDA kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """One step's allowed tokens for the constrained rows, as plain data for the workers:
    `bitmask[rows[seq_id]]` is the int32 bitmask (bit j of word j // 32 set: token j allowed) of
    the sequence's next token, over the model's whole vocabulary."""

    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32
    rows: dict[int, int]  # seq_id -> row of `bitmask`


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask (to -inf) the tokens `bitmask` disallows, in the given rows of `logits` [S, V]
    (`bitmask` [S, W]: row r's mask at row r). Logits past the bitmask's width (padding beyond the
    model's vocabulary) are masked too."""
    import xgrammar as xgr

    width = bitmask.shape[-1] * 32
    vocab = min(width, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
    if logits.shape[-1] > width:
        logits[rows, width:] = float("-inf")
