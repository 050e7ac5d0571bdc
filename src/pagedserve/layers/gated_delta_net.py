"""Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention, HF `Qwen3NextGatedDeltaNet` /
`Qwen3_5GatedDeltaNet`) over a state kept in the paged cache (`layers.recurrent_state`).

For a token with hidden state h (Hk key heads, Hv = r * Hk value heads, head sizes Dk, Dv):

- `qkv = in_proj_qkv(h)` (`[q | k | v]`, C = 2 Hk Dk + Hv Dv channels), `z = in_proj_z(h)`,
  `b = in_proj_b(h)`, `a = in_proj_a(h)` (Hv each);
- a causal depthwise convolution over the channels' last L inputs (`conv1d.weight [C, 1, L]`,
  no bias), then silu: its state is the last L - 1 inputs `[C, L - 1]`;
- q, k L2-normalised per head (eps 1e-6), q scaled by Dk^-0.5, each key head serving r
  consecutive value heads; `beta = sigmoid(b)`, decay `exp(g)` with
  `g = -exp(A_log) * softplus(a + dt_bias)`;
- the recurrence on the state `S [Hv, Dk, Dv]`: `S *= exp(g)`, `S += k (beta (v - k S))^T`,
  output `q S`;
- the gated RMSNorm of each head's output (`norm.weight [Dv]`, times `silu(z)`), `out_proj`.

NOTE (exactness): every token is advanced by the recurrent form, in one fixed order of float32
operations, whatever the chunking or batch -- never HF's chunked algorithm, whose sums depend on
the chunk. The ops are chosen so a token's bits depend only on its own values: products and sums
element by element, reductions over a fixed head dimension, the one-formula activation kernels
(`ops.activation`: silu, sigmoid), and softplus / exp computed on one token's row at a time
(torch's vector loops finish a tensor's last elements with scalar code that rounds exp
differently, and where that tail falls depends on the tensor's size). The recurrence itself
runs in place on the cache where the platform has a kernel (`ops.gated_delta_rule_paged`; on
CPU `kernels.cpu_recurrent`: one (sequence, head) at a time, its own fixed order), else in the
layer's torch loop (all sequences with a token at that position at once).

Qwen3-Next checkpoints fuse the projections (`in_proj_qkvz`, `in_proj_ba`, grouped per key
head): `split_fused_projections` rewrites them into the four above at load. Under tensor
parallelism each rank holds `Hk / N` key heads with their value heads (channels of the
convolution, rows of the projections, `A_log` / `dt_bias`), `out_proj` sums over the ranks.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSpec, set_shard
from pagedserve.layers.moe import invariant_sigmoid
from pagedserve.layers.recurrent_state import PagedState
from pagedserve.platforms import OpsUser

L2_EPS = 1e-6  # HF's `l2norm` (FLA's) of q and k


class GatedRMSNorm(nn.Module):
    """HF's `RMSNormGated`: `weight * x / rms(x) * silu(gate)` over each head (`weight [Dv]`,
    not zero-centred), in float32, cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.act = get_activation("silu")

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D] x 2 -> [..., D]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(x.dtype)
        return (y * self.act(gate.float())).to(x.dtype)


class GatedDeltaNet(OpsUser, nn.Module):
    """The Gated DeltaNet token mixer (see the module docstring), HF's parameter names (split
    projections, Qwen3.5's). `page`: values of one cache entry a token on this rank; `state`
    keeps the conv and recurrent states (`state.num_entries` cache entries, set by `bind`).
    `forward(h [T, H], caches, metas)`: the layer's cache entries and each one's metadata."""

    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, act: str, eps: float, page: int,
                 tp: TPContext = SINGLE, tiled: bool = False):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        # NOTE: value heads in llama.cpp's tiled order (a Qwen3.5 GGUF: value head j reads key
        # head j mod Hk), else HF's grouped one (j reads key head j // (Hv / Hk))
        self.tiled = tiled
        if tiled and tp.is_parallel:
            raise ValueError("tensor_parallel_size > 1: this Qwen3.5 GGUF keeps llama.cpp's tiled "
                             "value heads, whose key heads do not split by rank; serve it on one "
                             "rank, or the HF folder")
        self.num_k_heads = tp.split(num_k_heads, "linear_num_key_heads")
        self.num_v_heads = num_v_heads // tp.world_size
        self.head_k_dim, self.head_v_dim, self.kernel = head_k_dim, head_v_dim, conv_kernel
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, [key_dim, key_dim, value_dim], False, tp=tp)
        self.in_proj_z = ColumnParallelLinear(hidden_size, value_dim, False, tp=tp)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, False, tp=tp)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, False, tp=tp)
        self.channels = self.in_proj_qkv.out_features  # this rank's C
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.channels, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowParallelLinear(value_dim, hidden_size, False, tp=tp)
        self.act = get_activation(act)
        if tp.is_parallel:  # the conv's channels as in_proj_qkv's rows; the heads' scalars
            set_shard(self.conv1d.weight, self.in_proj_qkv.weight.shard)
            start = tp.rank * self.num_v_heads
            heads = ShardSpec(0, ((start, start + self.num_v_heads),), num_v_heads)
            set_shard(self.dt_bias, heads)
            set_shard(self.A_log, heads)
        self.state = PagedState([(self.channels, conv_kernel - 1),
                                 (self.num_v_heads, head_k_dim, head_v_dim)], page)

    @property
    def num_entries(self) -> int:
        return self.state.num_entries

    def bind(self, block_size: int, cache_dtype: torch.dtype) -> int:
        """Fit the state to the cache's blocks; returns the cache entries it takes."""
        return self.state.bind(block_size, cache_dtype)

    def forward(
        self,
        h: torch.Tensor,  # [T, H]
        caches: list[tuple[torch.Tensor, torch.Tensor]],  # per entry: [N, B, Hkv, D] x 2
        metas: list[AttentionMetadata],
    ) -> torch.Tensor:  # [T, H]
        t = h.shape[0]
        hv, dk, dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
        qkv = self.in_proj_qkv(h)  # [T, C]
        z = self.in_proj_z(h).view(t, hv, dv)  # [T, Hv, Dv]
        b, a = self.in_proj_b(h), self.in_proj_a(h)  # [T, Hv] each
        starts = metas[0].query_start_loc.tolist()  # [S + 1]
        n_seq, lags = len(starts) - 1, self.kernel - 1
        conv_state = self.state.gather(caches, metas, 0, self.channels * lags)  # [S, C * (L-1)]
        mixed, conv_state = self._conv(qkv.float(), conv_state.view(n_seq, self.channels, lags), starts)
        self.state.scatter(caches, metas, 0, conv_state.reshape(n_seq, -1))
        mixed = self.act(mixed)  # [T, C]
        key_dim = self.num_k_heads * dk
        q, k, v = mixed.split([key_dim, key_dim, hv * dv], dim=-1)
        q = _l2norm(q.reshape(t, self.num_k_heads, dk)) * dk**-0.5  # [T, Hk, Dk]
        k = _l2norm(k.reshape(t, self.num_k_heads, dk))  # [T, Hk, Dk]
        r = hv // self.num_k_heads
        if r > 1:
            if self.tiled:
                q, k = q.repeat(1, r, 1), k.repeat(1, r, 1)  # [T, Hv, Dk]
            else:
                q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)  # [T, Hv, Dk]
        v = v.reshape(t, hv, dv).contiguous()  # [T, Hv, Dv]
        beta = invariant_sigmoid(b.float().contiguous(), self.ops)  # [T, Hv]
        decay = self._decay(a.float())  # [T, Hv]
        out = self._recurrence(q, k, v, beta, decay, caches, metas, starts)  # [T, Hv, Dv]
        y = self.norm(out.to(h.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(y.reshape(t, hv * dv))  # [T, H]

    def _conv(self, x: torch.Tensor, state: torch.Tensor,
              starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`causal_conv` with this layer's weight."""
        return causal_conv(x, state, starts, self.conv1d.weight[:, 0, :].float())

    def _decay(self, a: torch.Tensor) -> torch.Tensor:  # [T, Hv] -> [T, Hv] fp32
        """`exp(-exp(A_log) * softplus(a + dt_bias))`, one token's row at a time (exactness)."""
        neg_a = -self.A_log.float().exp()  # [Hv]
        dt = self.dt_bias.float()
        return torch.stack([(neg_a * F.softplus(row + dt)).exp() for row in a.unbind(0)]) \
            if a.shape[0] else a

    def _recurrence(self, q, k, v, beta, decay, caches, metas, starts) -> torch.Tensor:  # [T, Hv, Dv]
        """The recurrence over every sequence's tokens, its state read and stored in the cache:
        the platform's kernel in place where it runs (`ops.gated_delta_rule_paged`), else the
        torch loop.
        NOTE: a process takes one or the other on every step (float32 CPU tensors, the
        extension built or not), so a request never mixes the two."""
        start, count = self.state.offset(1), self.state.sizes[1]
        flat, blocks, fresh = self.state.paged(caches, metas)
        out = self.ops.gated_delta_rule_paged(q, k, v, beta, decay, flat, blocks, start, fresh,
                                              metas[0].query_start_loc)
        if out is not None:
            return out
        state = self.state.gather(caches, metas, start, count)  # [S, Hv * Dk * Dv]
        state = state.view(-1, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        out = self._recur(q, k, v, beta, decay, state, starts)
        self.state.scatter(caches, metas, start, state.reshape(state.shape[0], -1))
        return out

    @staticmethod
    def _recur(q, k, v, beta, decay, state, starts) -> torch.Tensor:
        """Advance each sequence's `state [S, Hv, Dk, Dv]` (in place) over its tokens, one
        position at a time for all sequences that have one; the outputs `[T, Hv, Dv]`."""
        out = torch.empty_like(v)  # [T, Hv, Dv]
        lens = [starts[s + 1] - starts[s] for s in range(len(starts) - 1)]
        first = torch.tensor(starts[:-1], device=v.device)  # [S]
        for j in range(max(lens, default=0)):
            live = [s for s, n in enumerate(lens) if n > j]
            every = len(live) == len(lens)
            idx = None if every else torch.tensor(live, device=v.device)  # [S']
            rows = first + j if every else first[idx] + j  # [S']
            st = state if every else state[idx]  # [S', Hv, Dk, Dv]
            kt, qt = k[rows], q[rows]  # [S', Hv, Dk]
            st = st * decay[rows][..., None, None]
            kv_mem = (st * kt[..., None]).sum(dim=-2)  # [S', Hv, Dv]
            delta = (v[rows] - kv_mem) * beta[rows][..., None]  # [S', Hv, Dv]
            st = st + kt[..., None] * delta[..., None, :]
            out[rows] = (st * qt[..., None]).sum(dim=-2)
            if every:
                state.copy_(st)
            else:
                state[idx] = st
        return out


def causal_conv(x: torch.Tensor, state: torch.Tensor, starts: list[int],
                w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv (`w [C, L]` float32, no bias) of every token (`x [T, C]`
    float32) over its sequence's last L inputs (the state's L - 1 `[S, C, L - 1]`, then the
    step's): `[T, C]` float32, and the new states `[S, C, L - 1]`."""
    kernel = w.shape[1]
    lags = kernel - 1
    parts, rows, new_state = [], [], []
    base = 0
    for s in range(len(starts) - 1):
        n = starts[s + 1] - starts[s]
        seg = torch.cat([state[s].t(), x[starts[s]:starts[s + 1]]])  # [L-1 + n, C]
        parts.append(seg)
        rows.append(torch.arange(base, base + n))
        new_state.append(seg[n:].t())  # [C, L-1]: the last L - 1 inputs
        base += n + lags
    ext = torch.cat(parts)  # [sum(L-1 + n), C]
    first = torch.cat(rows).to(x.device)  # [T]: each token's oldest input row
    # NOTE: one fixed order for every token (oldest input first), element by element
    acc = ext.index_select(0, first) * w[:, 0]  # [T, C]
    for j in range(1, kernel):
        acc = acc + ext.index_select(0, first + j) * w[:, j]
    return acc, torch.stack(new_state)


def _l2norm(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def split_fused_projections(weights: Iterable[tuple[str, torch.Tensor]], *, num_k_heads: int,
                            num_v_heads: int, head_k_dim: int,
                            head_v_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's fused `linear_attn.in_proj_qkvz` / `in_proj_ba` (rows grouped per key head:
    q, k, then its r value heads' v, z; its r b's, then a's) as the split projections
    `in_proj_qkv` (`[q | k | v]`), `in_proj_z`, `in_proj_b`, `in_proj_a`; other tensors as
    they come."""
    r = num_v_heads // num_k_heads
    for name, t in weights:
        fused = name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"))
        if fused and not isinstance(t, torch.Tensor):
            t = t[:]  # a lazy safetensors slice: the whole tensor (its rows are regrouped)
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            g = t.reshape(num_k_heads, 2 * head_k_dim + 2 * r * head_v_dim, -1)  # [Hk, rows, H]
            q, k, v, z = g.split([head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=1)
            prefix = name[: -len("in_proj_qkvz.weight")]
            flat = [p.reshape(-1, t.shape[-1]) for p in (q, k, v, z)]
            yield prefix + "in_proj_qkv.weight", torch.cat(flat[:3])
            yield prefix + "in_proj_z.weight", flat[3].contiguous()
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            b, a = t.reshape(num_k_heads, 2 * r, -1).split([r, r], dim=1)  # [Hk, r, H] each
            prefix = name[: -len("in_proj_ba.weight")]
            yield prefix + "in_proj_b.weight", b.reshape(-1, t.shape[-1]).contiguous()
            yield prefix + "in_proj_a.weight", a.reshape(-1, t.shape[-1]).contiguous()
        else:
            yield name, t
