"""Jamba (`JambaForCausalLM`, AI21): Mamba (1) layers and attention layers, each followed by a
dense SwiGLU MLP or a mixture of experts.

As HF 5.x:
- layer i is attention when `i % attn_layer_period == attn_layer_offset`, else a Mamba mixer
  (`layers.mamba1`: Mamba 1 with Jamba's RMSNorms on dt, B and C); the attention has no
  positional encoding at all (NoPE: the identity rotation, bit for bit);
- layer i's feed-forward is an MoE (`layers.moe.FusedMoE`: softmax over `num_experts`, top
  `num_experts_per_tok`, the chosen weights NOT renormalized) when `i % expert_layer_period ==
  expert_layer_offset` and there is more than one expert, else a SwiGLU MLP;
- every layer is pre-norm (`input_layernorm`, `pre_ff_layernorm`), the final norm HF's
  `final_layernorm`.
The cache: one entry per attention layer, a mixer's state entries per Mamba layer
(`models.mamba_hybrid`). Tensor parallelism splits the Mamba channels (`layers.mamba1`).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mamba1 import Mamba1Mixer
from pagedserve.layers.moe import ExpertPlacement, FusedMoE, MoERouting, expert_param_name
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.mamba_hybrid import HybridCausalLM, HybridModel, PreNormHybridLayer, page_of

# HF's parameter names -> ours (a checkpoint name's segments)
_RENAMES = (
    (".feed_forward.router.", ".mlp.gate."),
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


def _period(config: Any, kind: str) -> tuple[int, int]:
    period, offset = int(getattr(config, f"{kind}_layer_period")), int(getattr(config, f"{kind}_layer_offset"))
    if period < 1 or not 0 <= offset < period:
        raise ValueError(f"config.{kind}_layer_offset ({offset}) must be in [0, {kind}_layer_period "
                         f"({period}))")
    return period, offset


def jamba_attention_layers(config: Any) -> list[bool]:
    """Whether each layer is attention (else Mamba): `i % attn_layer_period == attn_layer_offset`."""
    period, offset = _period(config, "attn")
    return [i % period == offset for i in range(config.num_hidden_layers)]


def jamba_expert_layers(config: Any) -> list[bool]:
    """Whether each layer's feed-forward is an MoE: `i % expert_layer_period ==
    expert_layer_offset`, and more than one expert (HF's `layers_num_experts`)."""
    period, offset = _period(config, "expert")
    many = int(config.num_experts) > 1
    return [many and i % period == offset for i in range(config.num_hidden_layers)]


def jamba_mixer(config: Any, page: int, tp: TPContext = SINGLE) -> Mamba1Mixer:
    """A Mamba (1) mixer from HF's `mamba_*` config attributes."""
    hidden = config.hidden_size
    dt_rank = config.mamba_dt_rank
    if dt_rank in (None, "auto"):
        dt_rank = math.ceil(hidden / 16)
    return Mamba1Mixer(hidden, intermediate_size=int(config.mamba_expand) * hidden,
                       state_size=int(config.mamba_d_state), dt_rank=int(dt_rank),
                       conv_kernel=int(config.mamba_d_conv), page=page,
                       conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.mamba_proj_bias),
                       activation=config.hidden_act, norm_eps=float(config.rms_norm_eps), tp=tp)


def jamba_layer(config: Any, attention: bool, experts: bool, page: int, expert_parallel: bool,
                tp: TPContext = SINGLE) -> PreNormHybridLayer:
    """Layer of Jamba: attention (no RoPE) or a Mamba mixer, then an MoE or the SwiGLU MLP."""
    hidden = config.hidden_size
    mlp: nn.Module
    if experts:  # softmax top-k, the chosen weights as they are (HF's JambaTopKRouter)
        mlp = FusedMoE(hidden, config.intermediate_size, int(config.num_experts),
                       MoERouting.from_config(config, renormalize=False), act=config.hidden_act,
                       tp=tp, expert_parallel=expert_parallel)
    else:
        mlp = LlamaMLP(hidden, config.intermediate_size, config.hidden_act, tp=tp)
    if attention:
        head_dim = head_dim_of(config)
        mixer = dict(attention=LlamaAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, qkv_bias=False, o_bias=False, tp=tp))
    else:
        mixer = dict(mamba=jamba_mixer(config, page, tp))
    return PreNormHybridLayer(hidden, config.rms_norm_eps, mlp, **mixer)


class JambaForCausalLM(HybridCausalLM):
    """Jamba decoder-only LM on a paged cache (see the module docstring); `tp` makes it this
    rank's shard (attention heads, Mamba channels, MLP and experts)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        expert_parallel = bool(getattr(config, "enable_expert_parallel", False))
        self.expert_placement = ExpertPlacement(max(int(config.num_experts), 1), tp,
                                                expert_parallel and int(config.num_experts) > 1)
        head_dim = head_dim_of(config)
        page = page_of(config, head_dim, tp)
        layers = [jamba_layer(config, attention, experts, page, self.expert_placement.expert_parallel, tp)
                  for attention, experts in zip(jamba_attention_layers(config), jamba_expert_layers(config))]
        self.model = HybridModel(config, layers, head_dim, rope=False, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, tp=tp)
        self.init_cache(tp.local_kv_heads(config.num_key_value_heads), head_dim)

    def _rename(self, name: str) -> str | tuple | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        name = super()._rename(name)
        if name is None:
            return None
        return expert_param_name(name, self.expert_placement)
