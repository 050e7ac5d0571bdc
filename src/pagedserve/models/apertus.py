"""Apertus (`ApertusForCausalLM`: Swiss AI's Apertus 8B / 70B).

Differences from Llama, as in HF 5.x:
- a non-gated MLP with the xIELU activation, whose four scalars each layer learns
  (`mlp.act_fn.alpha_p` / `alpha_n` / `beta` / `eps`: `layers.activation.XIELU`);
- per-head RMSNorm q / k norms before RoPE;
- its pre-norms named `attention_layernorm` and `feedforward_layernorm` (renamed at load onto
  Llama's `input_layernorm` / `post_attention_layernorm`);
- Llama 3's RoPE scaling by default (`rope_parameters`).
From GGUF: llama.cpp's "apertus" (`models.gguf_classic`: the xIELU scalars per layer as
`xielu.*` metadata arrays, Q/K rows not permuted).
NOTE: the fused decode kernel runs gated MLPs only: these layers run their modules (decode too).
"""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import XIELU
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.models.arcee import llama_attention
from pagedserve.models.base import RenamedCheckpoint
from pagedserve.models.llama import LlamaForCausalLM, LlamaModel


class ApertusDecoderLayer(ResidualBlock):
    """Llama's pre-norm block with q / k norms and Apertus's xIELU MLP."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        h, eps = config.hidden_size, config.rms_norm_eps
        if config.hidden_act != "xielu":
            act: Any = config.hidden_act
        else:
            act = XIELU()
        mlp = PlainMLP(h, config.intermediate_size, act, False, tp=tp)
        super().__init__(llama_attention(config, sliding_window, tp=tp, qk_norm=True), mlp, RMSNorm(h, eps),
                         RMSNorm(h, eps), parallel=False)


class ApertusModel(LlamaModel):
    """Llama's stack with Apertus's layers."""

    layer_class = ApertusDecoderLayer


class ApertusForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    """Apertus decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = ApertusModel
    checkpoint_renames = ((".attention_layernorm.", ".input_layernorm."),
                          (".feedforward_layernorm.", ".post_attention_layernorm."))
