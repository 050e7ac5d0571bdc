"""Laguna (`LagunaForCausalLM`, poolside's Laguna): a mixture-of-experts decoder with gated,
per-layer-width attention and sigmoid routing.

As in HF 5.x (`modeling_laguna.py`):
- attention: `num_attention_heads_per_layer[i]` query heads in layer i (the KV heads and head
  width shared by every layer), per-head q / k RMSNorms before RoPE, GQA, a sliding window on the
  "sliding_attention" layers of `layer_types`; RoPE per layer type (`rope_parameters[type]`, each
  with its own base and `partial_rotary_factor`, rotate-half on the first part); the output
  scaled by `softplus(g_proj(x))`, one gate per head (`gating` True / "per-head") or per channel
  ("per-element"), before `o_proj`;
- feed-forward: a gated MLP on the "dense" layers of `mlp_layer_types`, else experts routed by
  the sigmoid of the router's logits, chosen by `scores + e_score_correction_bias`, weighed by
  the unbiased scores over their sum, times `moe_routed_scaling_factor`, plus an ungated shared
  MLP (`shared_expert_intermediate_size`).
Refused (ValueError): `moe_router_logit_softcapping` > 0 and `moe_apply_router_weight_on_input`
(HF raises for the latter too).
NOTE: the checkpoint's names: `mlp.shared_experts.` (or HF's saved `mlp.shared_expert.`), the
selection bias as `mlp.experts.e_score_correction_bias` or `mlp.gate.e_score_correction_bias`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ColumnParallelLinear
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of, layer_sliding_windows
from pagedserve.models.mixtral import MoECausalLM, MoEModel


def laguna_heads(config: Any) -> list[int]:
    """Each layer's query heads (`num_attention_heads_per_layer`, else `num_attention_heads`)."""
    heads = getattr(config, "num_attention_heads_per_layer", None) or [config.num_attention_heads] * config.num_hidden_layers
    if len(heads) != config.num_hidden_layers:
        raise ValueError(f"config.num_attention_heads_per_layer has {len(heads)} entries for "
                         f"{config.num_hidden_layers} layers")
    return [int(h) for h in heads]


def _gate_per_head(config: Any) -> bool:
    gating = getattr(config, "gating", True)
    if gating is True or gating == "per-head":
        return True
    if gating == "per-element":
        return False
    raise ValueError(f"Laguna gating {gating!r} is not supported (True, 'per-head' or 'per-element')")


class LagunaAttention(LlamaAttention):
    """Llama attention with per-head q / k RMSNorms, this layer's own query-head count and a
    softplus output gate (`g_proj`: `[Hq]` or `[Hq * D]` per token)."""

    def __init__(self, config: Any, num_heads: int, sliding_window: int | None, *, tp: TPContext = SINGLE):
        head_dim = head_dim_of(config)
        eps = config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, num_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias,
                         qk_norm=lambda d: RMSNorm(d, eps), tp=tp)
        self.gate_per_head = _gate_per_head(config)
        self.g_proj = ColumnParallelLinear(config.hidden_size, num_heads if self.gate_per_head else num_heads * head_dim,
                                           False, tp=tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t = x.shape[0]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D] x 2
        q, k = norm_and_rotate(q, k, *rope, self.q_norm, self.k_norm, self.ops)
        o = self.attn(q, k, v, kv_cache, meta)  # [T, Hq, D]
        # NOTE: softplus in float64, rounded once: torch's vectorized and scalar-tail loops differ
        # in the last float32 bit, and which elements of a [T, Hq] gate fall in the tail depends
        # on T (the batch); their float64 results round to the same float32
        gate = F.softplus(self.g_proj(x).double()).to(o.dtype)  # [T, Hq] or [T, Hq*D]
        gate = gate.view(t, self.num_heads, 1) if self.gate_per_head else gate.view(t, self.num_heads, self.head_dim)
        return self.o_proj((o.view(t, self.num_heads, self.head_dim) * gate).reshape(t, -1))  # [T, H]


class LagunaModel(MoEModel):
    """The MoE stack with one RoPE table per layer type (each its own base and rotated part)."""

    def make_rotary_emb(self, config: Any) -> nn.Module:
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        return nn.ModuleDict({t: RotaryEmbedding(head_dim_of(config), rope_parameters(config, t),
                                                 config.max_position_embeddings)
                              for t in sorted(set(self.layer_types))})

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        ropes = {t: rope(positions, x.dtype) for t, rope in self.rotary_emb.items()}  # 2 x [T, R] each
        return x, [(ropes[t],) for t in self.layer_types]


def _check_config(config: Any) -> None:
    if float(getattr(config, "moe_router_logit_softcapping", 0.0) or 0.0) > 0.0:
        raise ValueError(f"Laguna moe_router_logit_softcapping={config.moe_router_logit_softcapping} "
                         "is not supported")
    if getattr(config, "moe_apply_router_weight_on_input", False):
        raise ValueError("Laguna moe_apply_router_weight_on_input=True is not supported")


class LagunaForCausalLM(MoECausalLM):
    """Laguna decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = LagunaModel
    moe_aliases = {".mlp.shared_experts.": ".mlp.shared_expert.",
                   ".mlp.experts.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}

    def __init__(self, config: Any, **kwargs):
        _check_config(config)
        super().__init__(config, **kwargs)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module] | None:
        heads, windows = laguna_heads(config), layer_sliding_windows(config)
        return lambda i: LagunaAttention(config, heads[i], windows[i], tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        types = getattr(config, "mlp_layer_types", None) or ["dense"] + ["sparse"] * (config.num_hidden_layers - 1)
        if types[layer] == "dense":
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="sigmoid", renormalize=True,
                             correction_bias=True,
                             routed_scaling_factor=float(getattr(config, "moe_routed_scaling_factor", 1.0)))
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts), routing,
                        act=config.hidden_act, shared_intermediate_size=int(config.shared_expert_intermediate_size or 0),
                        shared_act=config.hidden_act, tp=tp, expert_parallel=self.expert_placement.expert_parallel)
