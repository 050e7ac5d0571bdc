"""Helium (`HeliumForCausalLM`: Kyutai's Helium 1 2B).

Llama's layers, as in HF 5.x, but for:
- RMSNorms whose weight multiplies in float32 before the cast back (HF's `HeliumRMSNorm`:
  `layers.norms.Fp32WeightRMSNorm`);
- `attention_bias` on q / k / v only (the output projection has none);
- RoPE on interleaved pairs (2i with 2i + 1: HF's Helium `rotate_half`, GLM's layout).
NOTE: llama.cpp has no Helium architecture: no GGUF. The fused decode layer takes Llama's norm
numerics only: bf16 decode runs the modules (`platforms.cpu_decode` checks the norms).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.layers.linear import RowParallelLinear
from pagedserve.layers.norms import Fp32WeightRMSNorm
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of


class HeliumDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with Helium's norms and an unbiased output projection."""

    def __init__(self, config: Any, sliding_window: int | None, **kwargs):
        super().__init__(config, sliding_window, **kwargs)
        eps, h = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = Fp32WeightRMSNorm(h, eps)
        self.post_attention_layernorm = Fp32WeightRMSNorm(h, eps)
        attn = self.self_attn
        attn.rope_interleaved = True
        if attn.o_proj.bias is not None:
            attn.o_proj = RowParallelLinear(config.num_attention_heads * head_dim_of(config), h, False,
                                            tp=attn.o_proj.tp)


class HeliumModel(LlamaModel):
    """Llama's stack with Helium's layers and final norm."""

    layer_class = HeliumDecoderLayer
    rope_interleaved = True

    def make_norm(self, config: Any) -> nn.Module:
        return Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)


class HeliumForCausalLM(LlamaForCausalLM):
    """Helium decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = HeliumModel
