"""Gemma 4's attention and MoE block, and how its layers of two K/V widths share one page shape.

Gemma 4's full-attention layers have their own head size (`global_head_dim`, 512 in the
released configs, against 256 on the sliding layers) and may have their own KV head count
(`num_global_key_value_heads`), so a token's K (or V) row differs between the layer types:
16 x 256 sliding against 4 x 512 full (31B), 8 x 256 against 2 x 512 (26B-A4B), 1 x 256 against
1 x 512 (E2B). The paged cache has one page shape for all its entries (`core.kv_spec`); we pick
a row of `P` values a token (`kv_page_plan`) and map each layer onto it:

- a row `R >= P` (a multiple of P, P a multiple of the head size) takes `R / P` cache entries,
  each holding `P / D` of its KV heads (the query heads that read them go with them: attention
  is per head, so each entry is one attention call over its heads);
- a row `R < P` (P a multiple of R) takes one entry and repeats each of its KV heads `P / R`
  times (the query heads of a KV head then read one of its copies: the same scores).
`P` is the narrowest row, or the widest head if that is wider (E2B: its sliding layers repeat
their one head twice). Every entry is declared `(1 head, P)`; a layer views it as its own
`[P / D, D]` heads (a contiguous view).

KV sharing (`num_kv_shared_layers`): the last layers compute no K/V; each reads the entries of
the last earlier layer of its type (HF's "store" layer, `kv_sharing_modes`) with that layer's
K/V of the step's tokens (the stack hands them on): the attention call writes those rows again
(the same values into the same slots) and attends as the producer's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.moe import MoERouting, select_experts
from pagedserve.layers.norms import Fp32WeightRMSNorm, WeightlessRMSNorm
from pagedserve.layers.rotary import norm_and_rotate, rotate_half
from pagedserve.models.base import KVCache
from pagedserve.platforms import OpsUser


def kv_page_plan(rows: list[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """The page row `P` (values a token, per K / V) for layers of `(kv heads, head size)` rows
    (this rank's), and per row `(cache entries, KV head repeat)`: see the module docstring.
    ValueError when a row fits neither way."""
    page = max(min(h * d for h, d in rows), max(d for _, d in rows))
    plans = []
    for h, d in rows:
        r = h * d
        if r >= page and r % page == 0 and page % d == 0:
            plans.append((r // page, 1))
        elif r < page and page % r == 0:
            plans.append((1, page // r))
        else:
            raise ValueError(f"Gemma 4 KV rows {rows} (num_key_value_heads x head_dim per layer type: "
                             "head_dim / global_head_dim, num_global_key_value_heads) cannot share one "
                             f"page of {page} values")
    return page, plans


def _gemma_norm(size: int, eps: float) -> nn.Module:
    """HF's `Gemma4RMSNorm` with a scale: `x / rms(x) * w` in float32, cast back."""
    return Fp32WeightRMSNorm(size, eps)


class Gemma4Attention(OpsUser, nn.Module):
    """Gemma 4 self-attention: q/k norms (scale `w`, not Gemma 3's `1 + w`), a weightless v
    norm, attention scale 1, V = K's projection on `k_eq_v` layers (`attention_k_eq_v` full
    layers: no v_proj), RoPE of the layer type. `shared`: a KV-sharing consumer (q and o only).
    `entries` / `repeat`: how its K/V rows sit in the cache pages (`kv_page_plan`)."""

    def __init__(self, config: Any, num_kv_heads: int, head_dim: int, *, window: int | None,
                 k_eq_v: bool, shared: bool, page: int, plan: tuple[int, int], tp: TPContext = SINGLE):
        super().__init__()
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        eps = config.rms_norm_eps
        self.num_heads = tp.split(heads, "num_attention_heads")
        kv_part = tp.kv_head_part(num_kv_heads)
        self.num_kv_heads, self.head_dim = tp.local_kv_heads(num_kv_heads), head_dim
        self.q_proj = ColumnParallelLinear(hidden, heads * head_dim, bias, tp=tp)
        self.q_norm = _gemma_norm(head_dim, eps)
        self.shared = shared
        if not shared:
            self.k_proj = ColumnParallelLinear(hidden, num_kv_heads * head_dim, bias, tp=tp, part=kv_part)
            self.v_proj = None if k_eq_v else ColumnParallelLinear(hidden, num_kv_heads * head_dim, bias,
                                                                   tp=tp, part=kv_part)
            self.k_norm = _gemma_norm(head_dim, eps)
            self.v_norm = WeightlessRMSNorm(eps)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias, tp=tp)
        self.entries, self.repeat = plan
        if self.num_heads % (self.num_kv_heads * self.repeat) or self.num_heads % self.entries:
            raise ValueError(f"num_attention_heads ({heads}) does not split over the KV cache pages of "
                             f"this layer's {num_kv_heads} KV heads of {head_dim}")
        self.page_heads = page // head_dim  # KV heads one cache entry holds
        # one attention call per cache entry, over its KV heads and the query heads reading them
        self.attn = PagedAttention(self.num_heads // self.entries, self.page_heads, head_dim, 1.0, window)

    def kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]` (normed, rotated) and this layer's k, v `[T, Hkv, D]` of `x [T, H]`."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_norm(v)  # (before the in-place norm + RoPE of k, which v may be)
        q, k = norm_and_rotate(q, k, *rope, self.q_norm, self.k_norm, self.ops)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D]
        caches: list[KVCache],
        metas: list[AttentionMetadata],
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # the producer's k, v
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # [T, H], (k, v)
        if self.shared:
            t = x.shape[0]
            q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))  # [T, Hq, D]
            cos, sin = (r.unsqueeze(1) for r in rope)  # [T, 1, D]
            q = q * cos + rotate_half(q) * sin
            k, v = shared_kv
        else:
            q, k, v = self.kv(x, rope)
        return self.o_proj(self._attend(q, k, v, caches, metas)), (k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[KVCache],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # -> [T, Hq * D]
        if len(caches) != self.entries:
            raise ValueError(f"a Gemma 4 layer of {self.entries} cache entries got {len(caches)}")
        if self.repeat > 1:  # KV head j -> copies j * r .. j * r + r - 1
            k = k.repeat_interleave(self.repeat, dim=1)  # [T, Hkv * r, D]
            v = v.repeat_interleave(self.repeat, dim=1)
        d = self.head_dim

        def view(cache: KVCache) -> KVCache:  # [N + 1, B, 1, P] -> [N + 1, B, P / D, D]
            return tuple(None if c is None else c.view(c.shape[0], c.shape[1], self.page_heads, d)
                         for c in cache)

        if self.entries == 1:
            return self.attn(q, k, v, view(caches[0]), metas[0])
        n = self.entries
        outs = [self.attn(qi.contiguous(), ki.contiguous(), vi.contiguous(), view(c), m)
                for qi, ki, vi, c, m in zip(q.chunk(n, 1), k.chunk(n, 1), v.chunk(n, 1), caches, metas)]
        return torch.cat(outs, dim=-1)  # [T, Hq * D], heads in order


class Gemma4Router(OpsUser, nn.Module):
    """HF's `Gemma4TextRouter`: a weightless RMS norm of the layer's input, times `scale` and
    `hidden ** -0.5`, the `proj` logits; softmax, top-k, renormalized, then each chosen weight
    times its expert's `per_expert_scale`."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, experts = config.hidden_size, int(config.num_experts)
        self.norm = WeightlessRMSNorm(config.rms_norm_eps)
        self.proj = ColumnParallelLinear(hidden, experts, False, part=(0, 1))  # replicated
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))
        self.scalar_root_size = hidden**-0.5
        self.routing = MoERouting(top_k=int(config.top_k_experts), scoring="softmax", renormalize=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> 2 x [T, k]
        h = self.norm(x) * self.scale * self.scalar_root_size  # [T, H]
        weights, ids = select_experts(self.proj(h), self.routing)  # [T, k] fp32, int64
        return weights * self.per_expert_scale[ids], ids
