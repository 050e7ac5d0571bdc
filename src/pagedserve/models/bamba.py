"""Bamba (`BambaForCausalLM`, IBM / Princeton / CMU / UIUC): Mamba2 layers and Llama attention
layers (`attn_layer_indices`), each followed by a SwiGLU MLP.

As HF 5.x: layer i is attention when `i in config.attn_layer_indices`, else a Mamba2 mixer
(`layers.mamba2`, Granite 4.0-H's); attention applies RoPE to the first half of each head
(HF's config hardcodes `partial_rotary_factor = 0.5`); every layer is pre-norm (`input_layernorm`,
`pre_ff_layernorm`), the final norm HF's `final_layernorm`. The cache: one entry per attention
layer, a mixer's state entries per Mamba layer (`models.mamba_hybrid`).
"""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.mamba_hybrid import (
    HybridCausalLM, HybridModel, PreNormHybridLayer, mamba2_mixer, page_of)

# HF's parameter names -> ours (a checkpoint name's segments)
_RENAMES = (
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


def bamba_attention_layers(config: Any) -> set[int]:
    """The indices of the attention layers (`attn_layer_indices`); ValueError on one out of
    range."""
    indices = set(int(i) for i in (getattr(config, "attn_layer_indices", None) or []))
    if bad := sorted(i for i in indices if not 0 <= i < config.num_hidden_layers):
        raise ValueError(f"config.attn_layer_indices: {bad} not among the {config.num_hidden_layers} layers")
    return indices


def bamba_layer(config: Any, attention: bool, page: int, tp: TPContext = SINGLE) -> PreNormHybridLayer:
    """Layer of Bamba: attention or a Mamba2 mixer, then the SwiGLU MLP."""
    hidden = config.hidden_size
    mlp = LlamaMLP(hidden, config.intermediate_size, config.hidden_act,
                   bool(getattr(config, "mlp_bias", False)), tp=tp)
    if attention:
        head_dim, bias = head_dim_of(config), bool(getattr(config, "attention_bias", False))
        mixer = dict(attention=LlamaAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, qkv_bias=bias, o_bias=bias, tp=tp))
    else:
        mixer = dict(mamba=mamba2_mixer(config, page, tp))
    return PreNormHybridLayer(hidden, config.rms_norm_eps, mlp, **mixer)


class BambaForCausalLM(HybridCausalLM):
    """Bamba decoder-only LM on a paged cache (see the module docstring); `tp` makes it this
    rank's shard (attention heads, Mamba heads and groups, MLP)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        head_dim = head_dim_of(config)
        page = page_of(config, head_dim, tp)
        attention = bamba_attention_layers(config)
        layers = [bamba_layer(config, i in attention, page, tp) for i in range(config.num_hidden_layers)]
        self.model = HybridModel(config, layers, head_dim, rope=True, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, tp=tp)
        self.init_cache(tp.local_kv_heads(config.num_key_value_heads), head_dim)

    def _rename(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super()._rename(name)
