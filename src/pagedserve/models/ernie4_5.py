"""ERNIE 4.5 dense (`Ernie4_5ForCausalLM`, e.g. ERNIE-4.5-0.3B): Llama's layers with GLM's RoPE
layout and `use_bias`.

As in HF 5.x (`Ernie4_5Model`, ERNIE 4.5 MoE's dense layers, `models.ernie4_5_moe`):
- RoPE over the whole head on interleaved pairs (`layers.rotary`, `interleaved=True`; HF
  repeats each frequency twice and rotates pairs, in float32);
- `use_bias`: q / k / v / o and the MLP's projections have biases (the LM head none);
- the embedding tied to the LM head by default (`tie_word_embeddings`).
NOTE: the fused decode layer rotates halves, not pairs: these layers run their modules.
"""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.llama import (
    FusableDecoderLayer,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)


class Ernie4_5DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with `use_bias` on every projection and RoPE on pairs."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        FusableDecoderLayer.__init__(self)
        head_dim, eps = head_dim_of(config), config.rms_norm_eps
        bias = bool(getattr(config, "use_bias", False))
        self.self_attn = LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias, tp=tp,
            rope_interleaved=True)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class Ernie4_5Model(LlamaModel):
    """Llama's stack with ERNIE's layer and RoPE on interleaved pairs."""

    layer_class = Ernie4_5DecoderLayer
    rope_interleaved = True


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5 dense decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Ernie4_5Model
    tied_by_default = True

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers
