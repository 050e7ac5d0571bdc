"""OLMo (`OlmoForCausalLM`: OLMo-1B / 7B, OLMo 1.7, the HF-format ones).

Differences from Llama, as in HF 5.x:
- LayerNorms with neither weight nor bias (eps 1e-5, in float32: `layers.norms.WeightlessLayerNorm`)
  before attention and MLP and at the end, in the sequential block (`layers.residual`);
- `clip_qkv`: q, k and v clamped to `[-clip_qkv, clip_qkv]` after their projections;
- `attention_bias` on q / k / v / o; the gated SiLU MLP without biases.
From GGUF: llama.cpp's "olmo" (`models.gguf_classic`: no norm tensors, `attention.clamp_kqv`,
Q/K rows permuted).
NOTE: these layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import WeightlessLayerNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, head_dim_of


class OlmoAttention(LlamaAttention):
    """Llama's attention with q / k / v clamped to `clip_qkv` (None: not clamped) before RoPE."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        head_dim, bias = head_dim_of(config), bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias, tp=tp)
        clip = getattr(config, "clip_qkv", None)
        self.clip_qkv = None if clip is None else float(clip)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = norm_and_rotate(q, k, *rope, None, None, self.ops)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class OlmoDecoderLayer(ResidualBlock):
    """OLMo's sequential block on weightless LayerNorms."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        h = config.hidden_size
        super().__init__(OlmoAttention(config, sliding_window, tp=tp),
                         LlamaMLP(h, config.intermediate_size, config.hidden_act, tp=tp),
                         WeightlessLayerNorm(h), WeightlessLayerNorm(h), parallel=False)


class OlmoModel(LlamaModel):
    """Llama's stack with OLMo's layers and a weightless final LayerNorm."""

    layer_class = OlmoDecoderLayer

    def make_norm(self, config: Any) -> nn.Module:
        return WeightlessLayerNorm(config.hidden_size)


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = OlmoModel
