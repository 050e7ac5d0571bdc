"""VaultGemma (`VaultGemmaForCausalLM`: Google's differentially private Gemma).

Gemma 2 (`models.gemma2`: scaled embeddings, Gemma RMSNorms, soft-capped scores and logits,
alternating sliding and global layers, gelu-tanh gated MLP), as in HF 5.x, with a pre-norm
block: no post-attention and post-feedforward norms, `x + attn(input_norm(x))`, then
`x + mlp(pre_ff_norm(x))`. Always causal (`use_bidirectional_attention` is not one of its options).
NOTE: its layers run their modules (the fused decode kernel's Gemma numerics take the sandwich
norms).
HF folders only: llama.cpp's converter has no VaultGemma.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.models.base import KVCache
from pagedserve.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model


class VaultGemmaDecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer without its post-norms: x + attn(input_norm(x)), then
    x + mlp(pre_ff_norm(x))."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, tp=tp)
        del self.post_attention_layernorm
        del self.post_feedforward_layernorm

    def layer_norms(self) -> tuple:
        return (self.input_layernorm, None, self.pre_feedforward_layernorm, None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.unfused(x, rope, kv_cache, meta)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)  # [T, H]
        return x + self.mlp(self.pre_feedforward_layernorm(x))


class VaultGemmaModel(Gemma2Model):
    """Gemma 2's stack of VaultGemma layers."""

    layer_class = VaultGemmaDecoderLayer


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    """VaultGemma LM on a paged KV cache (see the module docstring)."""

    model_class = VaultGemmaModel
