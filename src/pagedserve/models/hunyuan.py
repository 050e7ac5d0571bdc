"""Tencent HunYuan: dense (`HunYuanDenseV1ForCausalLM`: Hunyuan 0.5B / 1.8B / 4B / 7B) and MoE
(`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B).

As in HF 5.x:
- attention: Llama's q / k / v / o (biases with `attention_bias`), then RoPE (rotate-half, whole
  head), then a per-head RMSNorm of q and k (`query_layernorm` / `key_layernorm`) *after* RoPE
  (unlike Qwen3's before it), on every layer;
- RoPE: the checkpoints' `{"type": "dynamic", "alpha": a}` is HF's fixed NTK-alpha scaling, no
  dynamic part: the base `rope_theta * a ** (head_dim / (head_dim - 2))` (`hunyuan_rope_parameters`);
  other rope types as Llama's;
- dense: Llama's gated MLP; MoE, every layer: a softmax router in float32 (`mlp.gate.wg`), the top
  `moe_topk` renormalized, experts of `intermediate_size`, beside one shared gated MLP of
  `intermediate_size` (`mlp.shared_mlp`, HF's whatever `num_shared_expert` says).
Cross-layer attention (`use_cla`, Hunyuan-Large) is not in HF's classes: refused.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import KVCache
from pagedserve.models.llama import (
    FusableDecoderLayer,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)
from pagedserve.models.mixtral import MoECausalLM, MoEModel


def hunyuan_rope_parameters(config: Any) -> dict:
    """The RoPE parameters of a HunYuan config: "dynamic" with an `alpha` is the default rotation
    on the base `rope_theta * alpha ** (d / (d - 2))` (HF's `compute_ntk_alpha_rope_parameters`,
    d the head size); any other as `layers.rotary.rope_parameters` reads it."""
    params = rope_parameters(config)
    if params["rope_type"] == "dynamic" and params.get("alpha"):
        d = head_dim_of(config)
        base = float(params["rope_theta"]) * float(params["alpha"]) ** (d / (d - 2))
        out = {"rope_type": "default", "rope_theta": base}
        if "partial_rotary_factor" in params:
            out["partial_rotary_factor"] = params["partial_rotary_factor"]
        return out
    return params


def check_hunyuan_config(config: Any) -> None:
    """ValueError naming what HF's HunYuan classes do not run either."""
    if getattr(config, "use_cla", False):
        raise ValueError("HunYuan: use_cla (cross-layer attention) is not supported")
    if getattr(config, "use_rotary_pos_emb", True) is False:
        raise ValueError("HunYuan: use_rotary_pos_emb false is not supported")


class HunYuanAttention(LlamaAttention):
    """Llama's attention with a per-head RMSNorm of q and k after RoPE."""

    def __init__(self, config: Any, sliding_window: int | None = None, *, tp: TPContext = SINGLE):
        head_dim, eps = head_dim_of(config), config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias, tp=tp)
        self.query_layernorm = RMSNorm(head_dim, eps)
        self.key_layernorm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q, k = norm_and_rotate(q, k, *rope, None, None, self.ops)  # RoPE alone
        q, k = self.query_layernorm(q), self.key_layernorm(k)  # NOTE: after RoPE (HF's order)
        if q_scale is not None:  # (LlamaAttention's option; no HunYuan config sets one)
            q = q * q_scale  # [T, Hq, D]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class HunYuanDenseV1DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with HunYuan's attention; it runs its modules (the fused decode
    kernel norms q / k before RoPE)."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        FusableDecoderLayer.__init__(self)
        eps = config.rms_norm_eps
        self.self_attn = HunYuanAttention(config, sliding_window, tp=tp)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.unfused(x, rope, kv_cache, meta)


class HunYuanRope:
    """The stack's RoPE on `hunyuan_rope_parameters` (a mixin before the stack class)."""

    rope_interleaved = False

    def make_rotary_emb(self, config: Any) -> nn.Module:
        return RotaryEmbedding(head_dim_of(config), hunyuan_rope_parameters(config),
                               config.max_position_embeddings)


class HunYuanDenseV1Model(HunYuanRope, LlamaModel):
    """Llama's stack with HunYuan's layers and RoPE."""

    layer_class = HunYuanDenseV1DecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """HunYuan dense decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = HunYuanDenseV1Model

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        check_hunyuan_config(config)
        super().__init__(config, tp=tp)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers


class HunYuanMoEV1Model(HunYuanRope, MoEModel):
    """Mixtral's stack with HunYuan's attention and RoPE."""


def _per_layer(config: Any, field: str) -> int:
    """A HunYuan MoE field that checkpoints give per layer (`moe_topk`, `num_experts`): one value,
    as HF's experts take (a list of different values: ValueError)."""
    value = getattr(config, field)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"HunYuan MoE: {field} {list(value)} differs across layers (not supported)")
        value = value[0]
    return int(value)


class HunYuanMoEV1ForCausalLM(MoECausalLM):
    """Hunyuan-A13B on a paged KV cache (see the module docstring)."""

    model_class = HunYuanMoEV1Model
    moe_aliases = {".mlp.gate.wg.": ".mlp.gate.", ".mlp.shared_mlp.": ".mlp.shared_expert."}

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        check_hunyuan_config(config)
        super().__init__(config, tp=tp)

    @staticmethod
    def num_experts(config: Any) -> int:
        return _per_layer(config, "num_experts")

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        return lambda i: HunYuanAttention(config, tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        routing = MoERouting(top_k=_per_layer(config, "moe_topk"), scoring="softmax", renormalize=True,
                             router_fp32=True)
        return FusedMoE(config.hidden_size, config.intermediate_size, self.num_experts(config), routing,
                        act=config.hidden_act, shared_intermediate_size=config.intermediate_size,
                        shared_act=config.hidden_act, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)
