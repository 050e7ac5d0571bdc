"""Apertus 1.5's text model (`Apertus1p5TextForCausalLM`: Swiss AI's Apertus v1.5).

Apertus (`models.apertus`: xIELU MLP with learned scalars, per-head q/k norms, Llama 3 RoPE)
with an extended vocabulary (visual and audio tokens) and, in the released checkpoints, a pruned
LM head: `output_vocab_size` rows, the ids `0 .. output_vocab_size - 1` (the multimodal tokens'
rows dropped). The logits keep the engine's width (`vocab_size`): the pruned ids get -inf, so
they are never sampled and every logprob equals HF's over its `output_vocab_size` logits.
The vision / audio tokenizers' weights, when a checkpoint carries them, are skipped (as HF does).
HF folders only: llama.cpp's converter has no Apertus 1.5.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.models.apertus import ApertusForCausalLM


def output_rows(config: Any) -> int | None:
    """The pruned LM head's rows (`output_vocab_size`), or None for a whole head."""
    rows = getattr(config, "output_vocab_size", None)
    if rows is None or int(rows) == int(config.vocab_size):
        return None
    if not 1 <= int(rows) <= int(config.vocab_size):
        raise ValueError(f"output_vocab_size ({rows}) must be in [1, vocab_size] ({config.vocab_size})")
    return int(rows)


class Apertus1p5TextForCausalLM(ApertusForCausalLM):
    """Apertus 1.5 text LM on a paged KV cache (see the module docstring)."""

    _SKIP = ("model.vision_tokenizer.", "model.audio_tokenizer.")

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        self.pruned_rows = output_rows(config)
        if self.pruned_rows is not None and getattr(config, "tie_word_embeddings", False):
            raise ValueError("Apertus 1.5 with a pruned LM head (output_vocab_size) and tie_word_embeddings "
                             "is not supported")
        super().__init__(config, tp=tp)

    def head_rows(self, config: Any) -> int:
        return self.pruned_rows or config.vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        logits = super().compute_logits(hidden)  # [S, rows] (rank 0; [S, 0] on the other ranks)
        if self.pruned_rows is None or logits.shape[-1] == 0:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))  # [S, V]
        full[:, : self.pruned_rows] = logits
        return full

    def _rename(self, name: str) -> str | tuple | None:
        return None if name.startswith(self._SKIP) else super()._rename(name)
