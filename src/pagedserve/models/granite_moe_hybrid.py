"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers and attention layers, each with
Granite MoE's feed-forward block and Granite's multipliers.

As HF 5.x:
- `config.layer_types[i]` is "mamba" (HF normalizes it to "linear_attention"): a Mamba2 mixer
  (`layers.mamba2`, the checkpoint's `mamba.*`), or "attention" ("full_attention"): Granite's
  attention, with RoPE only when `position_embedding_type == "rope"` (else none: NoPE, given
  the identity rotation, bit for bit);
- every layer: `x + mixer(norm(x)) * residual_multiplier`, then `x + ffn(norm(x)) *
  residual_multiplier`; the feed-forward is Granite MoE's experts plus the shared MLP
  (`models.granite_moe`), or, with `num_local_experts == 0`, the shared MLP alone;
- embeddings times `embedding_multiplier`, `attention_multiplier` as the attention scale,
  logits divided by `logits_scaling`.
The cache: one entry per attention layer, a mixer's state entries per Mamba layer
(`models.mamba_hybrid`).
"""

from __future__ import annotations

from typing import Any, Iterable

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.moe import ExpertPlacement, expert_param_name
from pagedserve.models.granite import LogitsScaling
from pagedserve.models.granite_moe import granite_moe_block, split_granite_moe
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.mamba_hybrid import (
    HybridCausalLM, HybridModel, PreNormHybridLayer, mamba2_mixer, page_of)

MAMBA, ATTENTION = "mamba", "attention"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def granite_hybrid_layer_types(config: Any) -> list[str]:
    """Each layer's kind, MAMBA or ATTENTION, from `config.layer_types` (HF's and the
    checkpoints' names); ValueError on another."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    if unknown := sorted(set(types) - set(_KINDS)):
        raise ValueError(f"config.layer_types: unsupported layer type(s) {unknown}; Granite 4.0-H has "
                         f"{sorted(_KINDS)}")
    return [_KINDS[t] for t in types]


def num_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", 0) or 0)


def granite_hybrid_layer(config: Any, kind: str, page: int, expert_parallel: bool,
                         tp: TPContext = SINGLE) -> PreNormHybridLayer:
    """A Mamba or attention layer with Granite's residual multiplier around both branches and
    its feed-forward block (see the module docstring)."""
    hidden = config.hidden_size
    if num_experts(config) > 0:
        mlp = granite_moe_block(config, tp, expert_parallel)
    else:  # the shared MLP alone
        mlp = LlamaMLP(hidden, int(config.shared_intermediate_size), config.hidden_act, tp=tp)
    if kind == ATTENTION:
        bias = bool(getattr(config, "attention_bias", False))
        mixer = dict(attention=LlamaAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim_of(config),
            scale=float(config.attention_multiplier), qkv_bias=bias, o_bias=bias, tp=tp))
    else:
        mixer = dict(mamba=mamba2_mixer(config, page, tp))
    return PreNormHybridLayer(hidden, config.rms_norm_eps, mlp, **mixer,
                              residual_multiplier=float(config.residual_multiplier))


class GraniteMoeHybridForCausalLM(LogitsScaling, HybridCausalLM):
    """Granite 4.0-H decoder-only LM on a paged cache (see the module docstring); `tp` makes it
    this rank's shard (attention heads, Mamba heads and groups, experts)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        expert_parallel = bool(getattr(config, "enable_expert_parallel", False))
        self.expert_placement = ExpertPlacement(max(num_experts(config), 1), tp,
                                                expert_parallel and num_experts(config) > 0)
        head_dim = head_dim_of(config)
        page = page_of(config, head_dim, tp)
        layers = [granite_hybrid_layer(config, kind, page, self.expert_placement.expert_parallel, tp)
                  for kind in granite_hybrid_layer_types(config)]
        self.model = HybridModel(config, layers, head_dim,
                                 rope=getattr(config, "position_embedding_type", None) == "rope",
                                 embedding_multiplier=float(config.embedding_multiplier), tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, tp=tp)
        self.init_cache(tp.local_kv_heads(config.num_key_value_heads), head_dim)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def _rename(self, name: str) -> str | tuple | None:
        name = super()._rename(name)
        if name is None:
            return None
        name = name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
        name = name.replace(".block_sparse_moe.", ".mlp.")
        shared = ".mlp.shared_expert." if num_experts(self.config) > 0 else ".mlp."
        name = name.replace(".shared_mlp.", shared)
        return expert_param_name(name, self.expert_placement)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF checkpoint tensors, Granite's fused ones split (`models.granite_moe`)."""
        shared = int(getattr(self.config, "shared_intermediate_size", 0) or 0)
        super().load_weights(split_granite_moe(weights, int(self.config.intermediate_size), shared))
