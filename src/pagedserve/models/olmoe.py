"""OLMoE: a Llama-like decoder whose attention normalizes the whole query and key projections
(one RMSNorm over all heads, before RoPE) and optionally clips q/k/v to `[-clip_qkv, clip_qkv]`,
with a mixture of experts in every layer (softmax router, `norm_topk_prob`, no shared expert).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import TPContext
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.norms import RMSNorm, sharded_mean_square
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.models.base import KVCache
from pagedserve.models.llama import head_dim_of
from pagedserve.models.mixtral import MoECausalLM
from pagedserve.platforms import OpsUser


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dimension split across tensor-parallel ranks: the mean of squares
    is summed over the ranks (one all-reduce of `[T, 1]`), then each rank scales its slice."""

    def __init__(self, local_size: int, full_size: int, eps: float, tp: TPContext):
        super().__init__(local_size, eps)
        self.full_size, self.tp = full_size, tp
        if tp.is_parallel:
            from pagedserve.layers.linear import ShardSpec, set_shard

            start = tp.rank * local_size
            set_shard(self.weight, ShardSpec(0, ((start, start + local_size),), full_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, n] -> [T, n]
        if not self.tp.is_parallel:
            return super().forward(x)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(sharded_mean_square(x32, self.tp, self.full_size) + self.eps)  # [T, n]
        return self.weight * x32.to(dtype)


class OlmoeAttention(OpsUser, nn.Module):
    """q/k/v/o projections; RMSNorm over the full q and k projections (not per head); q/k/v
    clipped to `clip_qkv` when set; RoPE; paged attention. A decode step may run it as the
    fused attention half (`platforms.cpu_decode`, its `whole_qk` / `clip_qkv` options)."""

    # the fused decode attention half computes exactly this forward (one rank, bf16: the plan
    # reads q/k/v/o_proj, q_norm / k_norm, attn, clip_qkv and the flag below)
    fused_attention_half = True
    whole_projection_qk_norm = True
    family = "OLMoE"  # (named in the errors: MiniMax-M2 reuses this attention)

    def __init__(self, config: Any, tp: TPContext):
        super().__init__()
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        eps = config.rms_norm_eps
        if tp.is_parallel and kv_heads % tp.world_size:
            raise ValueError(f"{self.family}'s k norm needs num_key_value_heads ({kv_heads}) divisible by "
                             f"tensor_parallel_size ({tp.world_size})")
        self.num_heads = tp.split(heads, "num_attention_heads")
        self.num_kv_heads = kv_heads // tp.world_size
        self.head_dim = head_dim
        self.q_proj = ColumnParallelLinear(hidden, heads * head_dim, bias, tp=tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * head_dim, bias, tp=tp)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * head_dim, bias, tp=tp)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias, tp=tp)
        # NOTE: HF sizes the k norm by (hidden // heads) * kv_heads, which is kv_heads * head_dim
        # whenever head_dim is the default (OLMoE configs have no head_dim).
        self.q_norm = ShardedRMSNorm(self.num_heads * head_dim, heads * head_dim, eps, tp)
        self.k_norm = ShardedRMSNorm(self.num_kv_heads * head_dim, kv_heads * head_dim, eps, tp)
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x))  # [T, Hq*D]
        k = self.k_norm(self.k_proj(x))  # [T, Hkv*D]
        v = self.v_proj(x)  # [T, Hkv*D]
        if self.clip_qkv is not None:
            c = float(self.clip_qkv)
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = norm_and_rotate(q.contiguous(), k.contiguous(), *rope, ops=self.ops)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class OlmoeForCausalLM(MoECausalLM):
    """OLMoE decoder-only LM (`OlmoeAttention`, a `FusedMoE` in every layer)."""

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        return lambda i: OlmoeAttention(config, tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        return FusedMoE(config.hidden_size, config.intermediate_size, int(config.num_experts),
                        MoERouting.from_config(config), act=config.hidden_act, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)
