"""Ministral 3 (`Ministral3ForCausalLM`; the text decoder of Ministral 3 and Devstral Small 2).

Mistral's layers (`models.llama`) with YaRN and one difference, as in HF 5.x: Llama 4's
attention temperature. After RoPE each query is multiplied by
`1 + beta * log(1 + floor(position / original_max_position_embeddings))`, with `beta` =
`rope_parameters["llama_4_scaling_beta"]` (the original length is YaRN's). Below the original
length the factor is exactly 1. llama.cpp writes these models as architecture "mistral3" with
`attention.temperature_scale` (`models.gguf_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaDecoderLayer, LlamaModel, MistralForCausalLM, head_dim_of

# Keys of Ministral 3's rope dict that are not RoPE's (HF: `ignore_keys_at_rope_validation`)
_NOT_ROPE_KEYS = ("llama_4_scaling_beta", "max_position_embeddings")


def attention_temperature(positions: torch.Tensor, beta: float | None,
                          original_max: int) -> torch.Tensor | None:  # [T] -> [T] fp32
    """Llama 4's per-position query scale (HF's `get_llama_4_attn_scale`, in its float32
    arithmetic; exactly 1 below `original_max`), or None without a beta."""
    if beta is None:
        return None
    return 1 + beta * torch.log(1 + torch.floor(positions / original_max))  # [T] fp32


class Ministral3DecoderLayer(LlamaDecoderLayer):
    """Mistral's layer, called with the step's query scale (None: no temperature)."""

    # below this context length every query's scale is exactly 1 (set by the stack)
    temperature_length: int = 0

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        q_scale: torch.Tensor | None,  # [T, 1, 1] in x's dtype, or None
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        # NOTE: the fused decode layer knows no query scale: a step whose positions all lie
        # below the original length (every scale exactly 1, so q * scale is q bit for bit; the
        # metadata's host-side max_seq_len says so without reading the device) may take the
        # plain layer, any other multiplies.
        if q_scale is None or 0 < meta.max_seq_len <= self.temperature_length:
            return super().forward(x, rope, kv_cache, meta)
        return self.unfused(x, rope, kv_cache, meta, q_scale)


class Ministral3Model(LlamaModel):
    """Mistral's stack whose layers also read the step's query scale."""

    layer_class = Ministral3DecoderLayer

    def make_rotary_emb(self, config: Any) -> nn.Module:
        params = rope_parameters(config)
        self.temperature_beta = params.get("llama_4_scaling_beta")
        self.temperature_length = int(params.get("original_max_position_embeddings")
                                      or config.max_position_embeddings)
        for layer in self.layers:
            layer.temperature_length = self.temperature_length
        rope = {k: v for k, v in params.items() if k not in _NOT_ROPE_KEYS}
        return RotaryEmbedding(head_dim_of(config), rope, config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, D]
        scale = attention_temperature(positions, self.temperature_beta, self.temperature_length)
        if scale is not None:
            scale = scale.to(x.dtype)[:, None, None]  # [T, 1, 1], cast as HF casts it
        return x, [(rope, scale)] * len(self.layers)


class Ministral3ForCausalLM(MistralForCausalLM):
    """Ministral 3 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Ministral3Model
