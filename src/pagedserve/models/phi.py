"""Phi-1.5 / Phi-2 (`PhiForCausalLM`).

Differences from Llama, as in HF 5.x:
- a parallel block with one LayerNorm (weight and bias): `x + attn(ln(x)) + mlp(ln(x))`
  (`layers.residual`);
- partial RoPE (`partial_rotary_factor`: Phi-2's 0.4 of each head), rotate-half;
- biases on q / k / v, the output projection (`dense`) and the MLP; a non-gated `gelu_new` MLP
  (`fc1`, `fc2`: `layers.mlp.PlainMLP`); a final LayerNorm (`final_layernorm`);
- `qk_layernorm`: one LayerNorm (weight and bias) over each head's q and k, shared by the heads;
- an LM head with a bias, not tied by default.
The modules take Llama's names (`o_proj`, `up_proj`, `down_proj`, `model.norm`); the
checkpoint's are renamed at load. From GGUF: llama.cpp's "phi2" (`models.gguf_classic`).
NOTE: LayerNorm layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.norms import HeadLayerNorm, LayerNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.layers.weights import split_fused_weights
from pagedserve.models.base import LMHeadBias, RenamedCheckpoint
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of


class PhiDecoderLayer(ResidualBlock):
    """Phi's parallel block: attention and MLP on one LayerNorm of the input (built as
    `LlamaModel` builds its layers; every projection has a bias)."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        head_dim, eps = head_dim_of(config), config.layer_norm_eps
        norm = (lambda d: HeadLayerNorm(d, eps=eps)) if getattr(config, "qk_layernorm", False) else None
        attn = LlamaAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              head_dim, scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=True,
                              o_bias=True, qk_norm=norm, tp=tp)
        mlp = PlainMLP(config.hidden_size, config.intermediate_size, config.hidden_act, True, tp=tp)
        super().__init__(attn, mlp, LayerNorm(config.hidden_size, eps=eps), None, parallel=True)


class PhiModel(LlamaModel):
    """Llama's stack with Phi's layers and a final LayerNorm."""

    layer_class = PhiDecoderLayer

    def make_norm(self, config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class PhiForCausalLM(RenamedCheckpoint, LMHeadBias, LlamaForCausalLM):
    """Phi-1.5 / Phi-2 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = PhiModel
    checkpoint_renames = (
        (".self_attn.dense.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".mlp.fc1.", ".mlp.up_proj."),
        (".mlp.fc2.", ".mlp.down_proj."),
        ("model.final_layernorm.", "model.norm."),
    )

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.init_lm_head_bias(config.vocab_size, True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """As the base class's, a fused `self_attn.qkv_proj` ([q; k; v] rows: a GGUF's
        `attn_qkv`) split into q / k / v."""
        c = self.config
        q, kv = c.num_attention_heads * head_dim_of(c), c.num_key_value_heads * head_dim_of(c)
        parts = lambda: [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]  # noqa: E731
        super().load_weights(split_fused_weights(weights, {"self_attn.qkv_proj": parts}))
