"""Jais 2 (`Jais2ForCausalLM`: Inception's Jais-2 8B / 70B).

Differences from Llama, as in HF 5.x:
- LayerNorms with biases (`layer_norm_eps`) before attention and MLP and at the end, in the
  sequential block (`layers.residual`);
- a non-gated MLP `down(act(up(x)))`, relu^2 by default (`hidden_act`, `layers.mlp.PlainMLP`),
  with biases (`mlp_bias`); `attention_bias` on q / k / v / o.
From GGUF: llama.cpp's "jais2" (`models.gguf_classic`; Q/K rows not permuted, rotate-half RoPE).
NOTE: LayerNorm layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.residual import ResidualBlock
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of


class Jais2DecoderLayer(ResidualBlock):
    """Jais 2's sequential block on LayerNorms, with a non-gated MLP."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        h, eps, head_dim = config.hidden_size, config.layer_norm_eps, head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", True))
        attn = LlamaAttention(h, config.num_attention_heads, config.num_key_value_heads, head_dim,
                              scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias,
                              tp=tp)
        mlp = PlainMLP(h, config.intermediate_size, config.hidden_act, bool(getattr(config, "mlp_bias", True)),
                       tp=tp)
        super().__init__(attn, mlp, nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps), parallel=False)


class Jais2Model(LlamaModel):
    """Llama's stack with Jais 2's layers and final LayerNorm."""

    layer_class = Jais2DecoderLayer

    def make_norm(self, config: Any) -> nn.Module:
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class Jais2ForCausalLM(LlamaForCausalLM):
    """Jais 2 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Jais2Model
