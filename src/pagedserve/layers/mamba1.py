"""The Mamba (1) mixer (HF's `MambaMixer`, `FalconMambaMixer`, `JambaMambaMixer`) whose state
lives in the paged KV cache (`layers.recurrent_state.PagedState`).

For tokens `h [T, hidden]` (I = `expand * hidden` channels, N state values, R = `dt_rank`):
1. `in_proj(h)` splits into `x [T, I]` and the gate `z [T, I]`;
2. `x` goes through a causal depthwise conv1d of kernel L (its state: the sequence's last L - 1
   `x` rows; the same conv as `layers.mamba2`), then SiLU;
3. `x_proj(x)` splits into `dt [T, R]`, `B`, `C` `[T, N]`, each RMS-normalized in Jamba
   (`dt_layernorm`, `b_layernorm`, `c_layernorm`, with weights) and Falcon Mamba (the same
   without weights), as they are in Mamba; `dt = softplus(dt_proj(dt))` `[T, I]`;
4. the selective scan, per channel d and state n: `h = exp(dt_d A_dn) h + dt_d B_n x_d` (the
   state `h [I, N]`, `A = -exp(A_log)` `[I, N]`), `y_d = sum_n C_n h_dn + D_d x_d`;
5. `out_proj(y * silu(z))`.

NOTE (exactness): as `layers.mamba2`, every token advances its sequence's state by the same
arithmetic, one token after the other, whether it comes in a long prefill, a chunk or a decode
step (HF's prefill scans the whole prompt at once: the two agree to float rounding); the scan's
`sum_n` runs in a fixed pairwise tree (`layers.mamba2.tree_sum`), the conv sums its taps oldest
first in float32, and the transcendentals (softplus, exp) run one token's row at a time. So a
token's bits do not depend on its batch, its chunking or recompute after preemption.

Tensor parallelism: each rank holds `I / N` channels (of x and z, the conv, dt_proj's rows,
`A_log`, `D`, the state): everything per channel is local; `x_proj` (dt, B, C from all
channels) and `out_proj` sum their partial products over the ranks. ValueError, naming
tensor_parallel_size, unless the ranks divide I.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.activation import get_activation
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSpec, set_shard
from pagedserve.layers.mamba2 import Mamba2Mixer, tree_sum
from pagedserve.layers.norms import RMSNorm, WeightlessRMSNorm
from pagedserve.layers.recurrent_state import KVPair, PagedState
from pagedserve.platforms import OpsUser


class Mamba1Mixer(OpsUser, nn.Module):
    """A Mamba (1) mixer (see the module docstring) over a paged state; parameter names as HF's
    (`in_proj`, `conv1d.weight` `[I, 1, L]`, `conv1d.bias`, `x_proj`, `dt_proj` (with a bias),
    `A_log` `[I, N]`, `D`, `out_proj`; Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`).
    `dt_bc_norm`: "weighted" (Jamba), "weightless" (Falcon Mamba) or None (Mamba). `page`: the
    values of one cache entry a token (None: fitted to the state, `layers.recurrent_state`).
    `forward(h [T, hidden], caches, metas)`: `caches` the layer's cache entries (K, V pairs),
    `metas` their attention metadata."""

    def __init__(self, hidden_size: int, *, intermediate_size: int, state_size: int, dt_rank: int,
                 conv_kernel: int, page: int | None, conv_bias: bool = True, proj_bias: bool = False,
                 activation: str = "silu", norm_eps: float = 1e-6, dt_bc_norm: str | None = "weighted",
                 tp: TPContext = SINGLE):
        super().__init__()
        if dt_bc_norm not in ("weighted", "weightless", None):
            raise ValueError(f"mamba dt / B / C norm must be 'weighted', 'weightless' or None, got {dt_bc_norm!r}")
        if conv_kernel < 2:
            raise ValueError(f"the mamba conv kernel must span at least 2 positions, got {conv_kernel}")
        if intermediate_size <= 0 or state_size <= 0 or dt_rank <= 0:
            raise ValueError(f"mamba sizes must be positive: intermediate {intermediate_size}, "
                             f"d_state {state_size}, dt_rank {dt_rank}")
        inter = tp.split(intermediate_size, "mamba intermediate channels")  # this rank's I
        self.inter, self.state_size, self.dt_rank = inter, state_size, dt_rank
        self.conv_kernel, self.conv_dim = conv_kernel, inter  # (what `conv` reads)
        # x and z: this rank's channels of each
        self.in_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], proj_bias,
                                            tp=tp)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(inter, 1, conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(inter)) if conv_bias else None
        # dt, B, C from all channels: this rank's partial product, summed over the ranks
        self.x_proj = RowParallelLinear(intermediate_size, dt_rank + 2 * state_size, False, tp=tp)
        self.dt_proj = ColumnParallelLinear(dt_rank, intermediate_size, True, tp=tp)
        self.A_log = nn.Parameter(torch.zeros(inter, state_size))
        self.D = nn.Parameter(torch.ones(inter))
        self.dt_bc_norm = dt_bc_norm
        if dt_bc_norm == "weighted":
            self.dt_layernorm = RMSNorm(dt_rank, norm_eps)
            self.b_layernorm = RMSNorm(state_size, norm_eps)
            self.c_layernorm = RMSNorm(state_size, norm_eps)
        elif dt_bc_norm == "weightless":  # (one module: no parameters)
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = WeightlessRMSNorm(norm_eps)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, proj_bias, tp=tp)
        self.act = get_activation(activation)
        self.gate_act = get_activation("silu")  # (HF's gate is SiLU whatever hidden_act)
        if tp.is_parallel:
            channels = ShardSpec(0, ((tp.rank * inter, (tp.rank + 1) * inter),), intermediate_size)
            for p in (self.conv1d.weight, self.conv1d.bias, self.A_log, self.D):
                set_shard(p, channels)
        # per sequence: the conv's last L - 1 input rows (oldest first), the SSM state (this
        # rank's channels)
        self.state = PagedState([(conv_kernel - 1, inter), (inter, state_size)], page)

    # the causal depthwise conv + activation, oldest tap first in float32 (Mamba2's, over x)
    conv = Mamba2Mixer.conv

    def bind(self, block_size: int, cache_dtype: torch.dtype) -> int:
        """Fit the state to the cache's blocks; returns the cache entries it takes."""
        return self.state.bind(block_size, cache_dtype)

    @property
    def num_entries(self) -> int:
        return self.state.num_entries

    def forward(self, h: torch.Tensor, caches: list[KVPair],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        x, gate = self.in_proj(h).split([self.inter, self.inter], dim=-1)  # [T, I] x 2
        rows = self.conv_kernel - 1
        qsl = metas[0].query_start_loc  # [S + 1]
        conv_state = self.state.gather(caches, metas, 0, rows * self.inter)  # [S, (L-1) I]
        s = conv_state.shape[0]
        x, conv_state = self.conv(x, conv_state.view(s, rows, self.inter), qsl.cpu())  # [T, I] fp32
        self.state.scatter(caches, metas, 0, conv_state.reshape(s, -1))
        dt, b, c = self.x_proj(x.to(h.dtype)).split(
            [self.dt_rank, self.state_size, self.state_size], dim=-1)  # [T, R], [T, N] x 2
        if self.dt_bc_norm is not None:
            dt = self.dt_layernorm(dt)
            b, c = self.b_layernorm(b), self.c_layernorm(c)
        dt = self.time_steps(self.ops.linear(dt, self.dt_proj.weight, None))  # [T, I] fp32
        a = -torch.exp(self.A_log.float())  # [I, N]
        start = self.state.offset(1)  # the SSM state's first value
        ssm_state = self.state.gather(caches, metas, start, self.inter * self.state_size)  # [S, I N]
        y, ssm_state = self.scan(x, b, c, dt, a, self.D.float(),
                                 ssm_state.view(s, self.inter, self.state_size), qsl.cpu())
        self.state.scatter(caches, metas, start, ssm_state.reshape(s, -1))
        y = y * self.gate_act(gate.float())  # [T, I] fp32
        return self.out_proj(y.to(h.dtype))  # [T, hidden]

    def time_steps(self, dt: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, I] fp32
        """`softplus(dt + dt_proj.bias)`, one token's row at a time (exactness: see the module
        docstring)."""
        bias = self.dt_proj.bias.float()
        rows = [F.softplus(row + bias) for row in dt.float().unbind(0)]  # T x [I]
        return torch.stack(rows) if rows else dt.float()

    def scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
             a: torch.Tensor, d: torch.Tensor, state: torch.Tensor,
             qsl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selective scan over every sequence's new tokens, one token position at a time
        (all sequences that have one at once): `x [T, I]` (after the conv), `b`, `c` `[T, N]`,
        `dt [T, I]` (after softplus), `a [I, N]`, `d [I]`, `state [S, I, N]`; returns
        `(y [T, I] with the D skip, the new state)`."""
        t = x.shape[0]
        x, b, c = x.float(), b.float(), c.float()
        skip = x * d  # [T, I]
        y = torch.empty(t, self.inter, dtype=torch.float32, device=x.device)
        starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]  # [S]
        state = state.float()
        longest = int(lens.max()) if len(lens) else 0
        for i in range(longest):
            live = (lens > i).nonzero().squeeze(1)  # [S_i]: the sequences with an i-th token
            every = len(live) == len(lens)
            rows = (starts[live] + i).to(x.device)  # [S_i]
            dbx = (dt[rows][:, :, None] * b[rows][:, None, :]) * x[rows][:, :, None]  # [S_i, I, N]
            # exp(dt A), one token's [I, N] at a time (a whole step's would be T I N values)
            decay = torch.stack([torch.exp(dt[r][:, None] * a) for r in rows.tolist()])  # [S_i, I, N]
            hs = state if every else state[live.to(x.device)]
            hs = hs * decay + dbx  # [S_i, I, N]
            y[rows] = tree_sum(hs * c[rows][:, None, :]) + skip[rows]  # [S_i, I]
            if every:
                state = hs
            else:
                state[live.to(x.device)] = hs
        return y, state
