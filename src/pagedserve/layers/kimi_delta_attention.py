"""Kimi Delta Attention (Kimi Linear's linear attention, HF `KimiLinearDeltaAttention`) over a
state kept in the paged cache (`layers.recurrent_state`).

For a token with hidden state h (H heads of size D):

- `q, k, v = q_proj(h), k_proj(h), v_proj(h)` (`[T, H D]` each), each through its causal
  depthwise convolution of kernel L (`q_conv1d`, `k_conv1d`, `v_conv1d`, no bias; one conv
  state `[3 H D, L - 1]`), then the activation (SiLU);
- q, k L2-normalised per head (eps 1e-6), q scaled by D^-0.5; `beta = sigmoid(b_proj(h))` `[T, H]`;
- the forget gate, one per key channel: `g = f_b_proj(f_a_proj(h)) + dt_bias` `[T, H, D]`,
  decay `exp(-exp(A_log[head]) * softplus(g))`;
- Gated DeltaNet's recurrence with that diagonal decay on the state `S [H, D, D]`:
  `S *= decay[:, None]` (key row i by channel i's decay), `S += k (beta (v - k S))^T`, out `q S`;
- the output norm of each head (`o_norm.weight [D]`, in float32) times
  `sigmoid(g_b_proj(g_a_proj(h)))`, then `o_proj`.

NOTE (exactness): as `layers.gated_delta_net`: the recurrence runs token by token in one fixed
order (`ops.kimi_delta_rule_paged`, the gated delta rule kernel's per-key-channel variant, in
place on the cache; else this module's torch loop), the conv oldest input first, softplus /
exp one token's row at a time, sigmoid on the one-formula kernel. Tensor parallelism is not
implemented (ValueError naming tensor_parallel_size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.gated_delta_net import _l2norm, causal_conv
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.moe import invariant_sigmoid
from pagedserve.layers.recurrent_state import PagedState
from pagedserve.platforms import OpsUser


class SigmoidGatedRMSNorm(nn.Module):
    """HF's `KimiLinearRMSNormGated`: `weight * x / rms(x) * sigmoid(gate)` over each head, all
    in float32 (the weight too), cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor,
                sigmoid) -> torch.Tensor:  # [..., D] x 2 -> [..., D]
        x32 = x.float()
        x32 = self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))
        return (x32 * sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(OpsUser, nn.Module):
    """The KDA token mixer (see the module docstring), HF's parameter names (`A_log` `[1, 1, H, 1]`
    as the checkpoint stores it). `page`: values of one cache entry a token, `tensors` the
    tensors of an entry (1 beside MLA layers: their latent page). `forward(h [T, hidden],
    caches, metas)`: the layer's cache entries and each one's metadata."""

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, conv_kernel: int, act: str,
                 eps: float, page: int, tensors: int = 2, tp: TPContext = SINGLE):
        super().__init__()
        if tp.is_parallel:
            raise ValueError("tensor_parallel_size > 1: Kimi Delta Attention is not split over ranks yet")
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {conv_kernel}")
        self.num_heads, self.head_dim, self.kernel = num_heads, head_dim, conv_kernel
        dim = num_heads * head_dim
        self.dim = dim
        self.q_proj = ColumnParallelLinear(hidden_size, dim, False)
        self.k_proj = ColumnParallelLinear(hidden_size, dim, False)
        self.v_proj = ColumnParallelLinear(hidden_size, dim, False)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = nn.Module()
            conv.weight = nn.Parameter(torch.empty(dim, 1, conv_kernel))
            setattr(self, name, conv)
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(dim))
        self.f_a_proj = ColumnParallelLinear(hidden_size, head_dim, False)
        self.f_b_proj = ColumnParallelLinear(head_dim, dim, False)
        self.b_proj = ColumnParallelLinear(hidden_size, num_heads, False)
        self.g_a_proj = ColumnParallelLinear(hidden_size, head_dim, False)
        self.g_b_proj = ColumnParallelLinear(head_dim, dim, False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = RowParallelLinear(dim, hidden_size, False)
        self.act = get_activation(act)
        self.state = PagedState([(3 * dim, conv_kernel - 1), (num_heads, head_dim, head_dim)], page,
                                tensors=tensors)

    @property
    def num_entries(self) -> int:
        return self.state.num_entries

    def bind(self, block_size: int, cache_dtype: torch.dtype) -> int:
        """Fit the state to the cache's blocks; returns the cache entries it takes."""
        return self.state.bind(block_size, cache_dtype)

    def forward(self, h: torch.Tensor, caches: list, metas: list[AttentionMetadata]) -> torch.Tensor:
        t, heads, d = h.shape[0], self.num_heads, self.head_dim  # h: [T, hidden]
        mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1).float()  # [T, 3 H D]
        starts = metas[0].query_start_loc.tolist()  # [S + 1]
        n_seq, lags = len(starts) - 1, self.kernel - 1
        conv_state = self.state.gather(caches, metas, 0, 3 * self.dim * lags)  # [S, 3 H D (L-1)]
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0, :].float()
        mixed, conv_state = causal_conv(mixed, conv_state.view(n_seq, 3 * self.dim, lags), starts, w)
        self.state.scatter(caches, metas, 0, conv_state.reshape(n_seq, -1))
        q, k, v = self.act(mixed).split(self.dim, dim=-1)  # [T, H D] x 3
        q = _l2norm(q.reshape(t, heads, d)) * d**-0.5  # [T, H, D]
        k = _l2norm(k.reshape(t, heads, d))  # [T, H, D]
        v = v.reshape(t, heads, d).contiguous()  # [T, H, D]
        beta = invariant_sigmoid(self.b_proj(h).float().contiguous(), self.ops)  # [T, H]
        decay = self._decay(self.f_b_proj(self.f_a_proj(h)).float()).view(t, heads, d)  # [T, H, D]
        out = self._recurrence(q, k, v, beta, decay, caches, metas, starts)  # [T, H, D]
        gate = self.g_b_proj(self.g_a_proj(h)).view(t, heads, d)  # [T, H, D]
        y = self.o_norm(out.to(h.dtype), gate, lambda g: invariant_sigmoid(g.contiguous(), self.ops))
        return self.o_proj(y.reshape(t, self.dim))  # [T, hidden]

    def _decay(self, g: torch.Tensor) -> torch.Tensor:  # [T, H D] -> [T, H D] fp32
        """`exp(-exp(A_log) * softplus(g + dt_bias))`, one token's row at a time (exactness)."""
        neg_a = -self.A_log.float().view(self.num_heads, 1).exp().expand(-1, self.head_dim).reshape(-1)
        bias = self.dt_bias.float()
        return torch.stack([(neg_a * F.softplus(row + bias)).exp() for row in g.unbind(0)]) \
            if g.shape[0] else g

    def _recurrence(self, q, k, v, beta, decay, caches, metas, starts) -> torch.Tensor:  # [T, H, D]
        """The recurrence in place on the cache (`ops.kimi_delta_rule_paged`), else the torch
        loop (a process takes one or the other on every step)."""
        start, count = self.state.offset(1), self.state.sizes[1]
        flat, blocks, fresh = self.state.paged(caches, metas)
        out = self.ops.kimi_delta_rule_paged(q, k, v, beta, decay, flat, blocks, start, fresh,
                                             metas[0].query_start_loc)
        if out is not None:
            return out
        state = self.state.gather(caches, metas, start, count)  # [S, H * D * D]
        state = state.view(-1, self.num_heads, self.head_dim, self.head_dim)
        out = self._recur(q, k, v, beta, decay, state, starts)
        self.state.scatter(caches, metas, start, state.reshape(state.shape[0], -1))
        return out

    @staticmethod
    def _recur(q, k, v, beta, decay, state, starts) -> torch.Tensor:
        """Advance each sequence's `state [S, H, D, D]` (in place) over its tokens, one position
        at a time for all sequences that have one; the outputs `[T, H, D]`."""
        out = torch.empty_like(v)  # [T, H, D]
        lens = [starts[s + 1] - starts[s] for s in range(len(starts) - 1)]
        first = torch.tensor(starts[:-1], device=v.device)  # [S]
        for j in range(max(lens, default=0)):
            live = [s for s, n in enumerate(lens) if n > j]
            every = len(live) == len(lens)
            idx = None if every else torch.tensor(live, device=v.device)  # [S']
            rows = first + j if every else first[idx] + j  # [S']
            st = state if every else state[idx]  # [S', H, D, D]
            kt, qt = k[rows], q[rows]  # [S', H, D]
            st = st * decay[rows][..., None]  # key row i times channel i's decay
            kv_mem = (st * kt[..., None]).sum(dim=-2)  # [S', H, D]
            delta = (v[rows] - kv_mem) * beta[rows][..., None]  # [S', H, D]
            st = st + kt[..., None] * delta[..., None, :]
            out[rows] = (st * qt[..., None]).sum(dim=-2)
            if every:
                state.copy_(st)
            else:
                state[idx] = st
        return out
