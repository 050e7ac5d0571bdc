"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, Xiaomi): sliding / full attention layers with wide
query-key heads and narrower value heads, DeepSeek-V3-routed experts.

As in HF 5.x (`modeling_mimo_v2_flash.py`):
- attention: q / k heads of `head_dim`, value heads of `v_head_dim`; the values times
  `attention_value_scale`; scale head_dim ** -0.5; RoPE per layer type (`rope_parameters[type]`,
  rotate-half on `int(head_dim * partial_rotary_factor)` dims); the "sliding_attention" layers of
  `layer_types` have twice the KV heads, a window of `sliding_window` and a learned sink logit per
  query head (`attention_sink_bias`), the full ones neither;
- feed-forward: a gated MLP on the "dense" layers of `mlp_layer_types`, else DeepSeek-V3's
  routing (float32 router, sigmoid + `e_score_correction_bias`, grouped top-k, renormalized,
  `routed_scaling_factor`) without shared experts.
In the paged cache every layer holds `2 * num_key_value_heads` heads of `head_dim` values (one
KV spec for all: `core.kv_spec` groups layers of one shape): a full layer stores each of its KV
heads twice (query head i reads stored head `i // (group / 2)`, a copy of its own: exact), and
the values are zero-padded to `head_dim` (their attention output's pad columns dropped).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.models.base import KVCache
from pagedserve.models.laguna import LagunaModel
from pagedserve.models.llama import LlamaMLP, head_dim_of, layer_sliding_windows
from pagedserve.models.mixtral import MoECausalLM
from pagedserve.platforms import OpsUser


class MiMoV2FlashAttention(OpsUser, nn.Module):
    """One MiMo attention layer over `2 * num_key_value_heads` cached heads (see the module
    docstring); `sinks` `[Hq]` on the sliding layers."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        super().__init__()
        if tp.is_parallel:
            raise ValueError("MiMo-V2-Flash under tensor parallelism is not supported")
        h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.v_head_dim = d, dv = head_dim_of(config), int(config.v_head_dim)
        if dv > d:
            raise ValueError(f"MiMo-V2-Flash v_head_dim {dv} > head_dim {d} is not supported")
        if heads % (2 * kv):
            raise ValueError(f"num_attention_heads {heads} must be a multiple of 2 x num_key_value_heads {kv}")
        self.sliding = sliding_window is not None
        self.num_heads, self.num_kv_heads = heads, 2 * kv if self.sliding else kv
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = ColumnParallelLinear(h, heads * d, bias, tp=tp)
        self.k_proj = ColumnParallelLinear(h, self.num_kv_heads * d, bias, tp=tp)
        self.v_proj = ColumnParallelLinear(h, self.num_kv_heads * dv, bias, tp=tp)
        self.o_proj = RowParallelLinear(heads * dv, h, False, tp=tp)
        self.sinks = nn.Parameter(torch.zeros(heads)) if self.sliding else None
        scale = getattr(config, "attention_value_scale", None)
        self.v_scale = 1.0 if scale is None else float(scale)
        self.attn = PagedAttention(heads, 2 * kv, d, d**-0.5, sliding_window)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t, d, dv = x.shape[0], self.head_dim, self.v_head_dim
        q = self.q_proj(x).view(t, self.num_heads, d)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, d)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, dv) * self.v_scale  # [T, Hkv, Dv]
        q, k = norm_and_rotate(q, k, *rope, None, None, self.ops)
        if not self.sliding:  # each KV head stored twice (see the module docstring)
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # [T, 2 Hkv, ...]
        if dv < d:
            v = torch.nn.functional.pad(v, (0, d - dv))  # [T, 2 Hkv, D]
        sinks = {"sinks": self.sinks} if self.sliding else {}  # (the full layers' call takes none)
        o = self.attn(q, k.contiguous(), v.contiguous(), kv_cache, meta, **sinks)  # [T, Hq, D]
        return self.o_proj(o.view(t, self.num_heads, d)[..., :dv].reshape(t, -1))  # [T, H]


def _mlp_types(config: Any) -> list[str]:
    n = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None) or ["dense"] + ["sparse"] * (n - 1)
    if len(types) != n:
        raise ValueError(f"config.mlp_layer_types has {len(types)} entries for {n} layers")
    return list(types)


class MiMoV2FlashForCausalLM(MoECausalLM):
    """MiMo-V2-Flash decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = LagunaModel  # (the MoE stack with a RoPE table per layer type)
    # (the hub's sink name; a GGUF file's attn_sinks.weight, `models.gguf_mimo2`)
    moe_aliases = {".self_attn.attention_sink_bias": ".self_attn.sinks", ".self_attn.sinks.weight": ".self_attn.sinks"}

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        spec = self.kv_cache_spec  # the sliding layers add their sinks (no memory rule)
        self.kv_cache_spec = dataclasses.replace(spec, layers=tuple(
            dataclasses.replace(s, sinks=True) if w is not None else s
            for s, w in zip(spec.layer_specs(), self.sliding_windows(config))))

    def _init_head(self, config: Any, embedding: nn.Module, *, head_in: int, num_kv_heads: int,
                   head_dim: int, tp: TPContext) -> None:
        super()._init_head(config, embedding, head_in=head_in, num_kv_heads=2 * num_kv_heads,
                           head_dim=head_dim, tp=tp)

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.n_routed_experts)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module] | None:
        windows = layer_sliding_windows(config)
        return lambda i: MiMoV2FlashAttention(config, windows[i], tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if _mlp_types(config)[layer] == "dense":
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        routing = MoERouting.from_config(config, scoring="sigmoid", topk_method="noaux_tc", router_fp32=True)
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.n_routed_experts), routing,
                        act=config.hidden_act, tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def _rename(self, name: str) -> str | tuple | None:
        prefix = "model.layers."
        if name.startswith("model.mtp.") or (
                name.startswith(prefix) and int(name[len(prefix):].split(".", 1)[0]) >= self.config.num_hidden_layers):
            return None  # multi-token-prediction modules (not run)
        return super()._rename(name)
