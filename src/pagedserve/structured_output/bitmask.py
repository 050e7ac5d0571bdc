"""The worker's side of structured outputs: the step's token bitmask as plain data, and its
application to the logits (our CPU kernel, `kernels.cpu_grammar`, else torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_grammar


@dataclass
class GrammarBitmask:
    """One step's allowed tokens for the constrained rows, as plain data for the workers:
    `bitmask[rows[seq_id]]` is the int32 bitmask (bit j of word j // 32 set: token j allowed) of
    the sequence's next token, over the model's whole vocabulary. A speculative row's position j
    (after its first j drafts) has `bitmask[rows[seq_id] + j]`."""

    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32
    rows: dict[int, int]  # seq_id -> row of `bitmask`


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> None:
    """Mask (to -inf, in place) the tokens `masks[g]` disallows in row `rows[g]` of `logits`
    [S, V] (`masks` [G, W] int32). Logits past the masks' width (padding beyond the model's
    vocabulary) are masked too. On the CPU kernel where it applies, else in torch.

    NOTE: not xgrammar's `apply_token_bitmask_inplace`: on CPU it takes ~55 ms for 16 rows of a
    262,144-token vocabulary, and (0.2.9) with a vocabulary that is not a multiple of 32 it writes
    -inf into the next row's first token."""
    if not rows or cpu_grammar.apply_token_bitmask(logits, masks, rows):
        return
    v = logits.shape[-1]
    width = masks.shape[-1] * 32
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    allowed = ((masks.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), width)  # [G, 32W]
    if width < v:
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), v - width)], dim=1)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, index)
    logits.index_copy_(0, index, picked.masked_fill_(~allowed[:, :v].to(logits.device),
                                                     float("-inf")))


def is_allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether the row bitmask `mask` [W] allows `token`."""
    return 0 <= token < mask.shape[-1] * 32 and bool((int(mask[token // 32]) >> (token % 32)) & 1)


def first_allowed(mask: torch.Tensor) -> int | None:
    """The smallest token the row bitmask `mask` [W] allows; None when it allows none."""
    nz = torch.nonzero(mask)
    if nz.numel() == 0:
        return None
    w = int(nz[0, 0])
    word = int(mask[w]) & 0xFFFFFFFF
    return 32 * w + (word & -word).bit_length() - 1
