"""Gemma (`GemmaForCausalLM`: Gemma 1, CodeGemma): the Llama decoder with Gemma's norms,
scaled embeddings and a GeLU-gated MLP.

Differences from Llama, as in HF 5.x:
- embeddings multiplied by sqrt(hidden_size) rounded to the model dtype;
- Gemma RMSNorm (`x * (1 + w)` in float32) as the input, pre-MLP and final norms;
- the MLP's activation is `hidden_activation` (gelu_pytorch_tanh); tied LM head by default.
NOTE: the fused decode layer's pre-norm mode has Llama's norm numerics: these layers run their
modules (`platforms/cpu_decode.py` refuses mixed numerics).
llama.cpp writes it as architecture "gemma" (norms stored as 1 + w).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import GemmaRMSNorm
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def gemma_activation(config: Any) -> str:
    """The MLP's activation: `hidden_activation` (HF's Gemma reads it), else `hidden_act`."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with Gemma's norms and activation."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, qkv_bias=qkv_bias, qk_norm=qk_norm, tp=tp)
        eps = config.rms_norm_eps
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, gemma_activation(config), tp=tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)


class GemmaModel(LlamaModel):
    """Llama's stack with Gemma's layers, scaled embeddings and final norm."""

    layer_class = GemmaDecoderLayer

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = nn.Buffer(torch.tensor(config.hidden_size**0.5, dtype=torch.float32),
                                     persistent=False)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)
        return x * self.embed_scale.to(x.dtype), extras  # sqrt(hidden) rounded to the dtype, as HF


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = GemmaModel
    tied_by_default = True

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers
