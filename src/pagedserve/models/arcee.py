"""Arcee (`ArceeForCausalLM`: AFM-4.5B).

Llama's layers, as in HF 5.x, with a non-gated MLP: `down(relu(up(x))^2)` (`up_proj`,
`down_proj`, `mlp_bias`: `layers.mlp.PlainMLP`), in the sequential pre-norm block
(`layers.residual`). From GGUF: llama.cpp's "arcee" (`models.gguf_classic`; Q/K rows permuted as
Llama's).
NOTE: the fused decode kernel runs gated MLPs only: these layers run their modules (decode too).
"""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of


def llama_attention(config: Any, sliding_window: int | None, *, tp: TPContext, qk_norm: bool = False,
                    ) -> LlamaAttention:
    """Llama's attention as HF's `LlamaAttention` builds it from `config` (`attention_bias` on
    q / k / v / o; per-head RMSNorm q / k norms with `qk_norm`)."""
    head_dim, bias = head_dim_of(config), bool(getattr(config, "attention_bias", False))
    eps = config.rms_norm_eps
    return LlamaAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                          scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias,
                          qk_norm=(lambda d: RMSNorm(d, eps)) if qk_norm else None, tp=tp)


class ArceeDecoderLayer(ResidualBlock):
    """Llama's pre-norm block with Arcee's relu^2 MLP."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        h, eps = config.hidden_size, config.rms_norm_eps
        mlp = PlainMLP(h, config.intermediate_size, config.hidden_act, bool(getattr(config, "mlp_bias", False)),
                       tp=tp)
        super().__init__(llama_attention(config, sliding_window, tp=tp), mlp, RMSNorm(h, eps), RMSNorm(h, eps),
                         parallel=False)


class ArceeModel(LlamaModel):
    """Llama's stack with Arcee's layers."""

    layer_class = ArceeDecoderLayer


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = ArceeModel
