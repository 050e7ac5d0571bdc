"""Nemotron (`NemotronForCausalLM`: Nemotron-4 / Minitron, Nemotron-Mini).

Differences from Llama, as in HF 5.x:
- "layernorm1p": LayerNorms (with bias) whose weight is stored as an offset, `ln(x) * (1 + w) +
  b` (`layers.norms.LayerNorm1P`, `norm_eps`), before attention and MLP and at the end, in the
  sequential block (`layers.residual`);
- partial RoPE (`partial_rotary_factor`, 0.5 by default), rotate-half;
- a non-gated MLP `down(relu(up(x))^2)` (`layers.mlp.PlainMLP`, `mlp_bias`); `attention_bias` on
  q / k / v / o.
From GGUF: llama.cpp's "nemotron" (`models.gguf_classic`: its norms stored as 1 + w).
NOTE: LayerNorm layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.norms import LayerNorm1P
from pagedserve.layers.residual import ResidualBlock
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of


class NemotronDecoderLayer(ResidualBlock):
    """Nemotron's sequential block on layernorm1p, with a relu^2 MLP."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        h, eps, head_dim = config.hidden_size, config.norm_eps, head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        attn = LlamaAttention(h, config.num_attention_heads, config.num_key_value_heads, head_dim,
                              scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias,
                              tp=tp)
        mlp = PlainMLP(h, config.intermediate_size, config.hidden_act, bool(getattr(config, "mlp_bias", False)),
                       tp=tp)
        super().__init__(attn, mlp, LayerNorm1P(h, eps=eps), LayerNorm1P(h, eps=eps), parallel=False)


class NemotronModel(LlamaModel):
    """Llama's stack with Nemotron's layers and final layernorm1p."""

    layer_class = NemotronDecoderLayer

    def make_norm(self, config: Any) -> nn.Module:
        return LayerNorm1P(config.hidden_size, eps=config.norm_eps)


class NemotronForCausalLM(LlamaForCausalLM):
    """Nemotron decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = NemotronModel
