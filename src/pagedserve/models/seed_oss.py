"""Seed-OSS (`SeedOssForCausalLM`, ByteDance Seed-OSS-36B): the Llama decoder whose biases are set
apart: q / k / v by `attention_bias`, o by `attention_out_bias`, the MLP by `mlp_bias` (as in HF
5.x; its residual dropout does nothing at inference). From GGUF: llama.cpp's "seed_oss"."""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import RowParallelLinear
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class SeedOssDecoderLayer(LlamaDecoderLayer):
    """Llama's block with the o projection's bias from `attention_out_bias`."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, qkv_bias=qkv_bias, qk_norm=qk_norm, tp=tp)
        attn = self.self_attn
        out_bias = bool(getattr(config, "attention_out_bias", False))
        if (attn.o_proj.bias is not None) != out_bias:  # Llama's follows attention_bias
            attn.o_proj = RowParallelLinear(config.num_attention_heads * attn.head_dim, config.hidden_size,
                                            out_bias, tp=tp)


class SeedOssModel(LlamaModel):
    layer_class = SeedOssDecoderLayer


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = SeedOssModel
