"""The Mamba2 mixer (HF's `Mamba2Mixer` / `BambaMixer`: Bamba, Granite 4.0-H, Nemotron-H,
Falcon-H1) whose state lives in the paged KV cache (`layers.recurrent_state.PagedState`).

For tokens `h [T, hidden]`:
1. `in_proj(h)` splits into the gate `z [T, I]`, `xBC [T, I + 2 G N]` and `dt [T, H]`
   (I = H heads x P head size; G groups of N state values; heads of one group share its B, C);
2. `xBC` goes through a causal depthwise conv1d of kernel L (its state: the sequence's last
   L - 1 `xBC` rows), then the activation (SiLU), and splits into `x [T, H, P]`, `B`, `C`
   `[T, G, N]`;
3. the SSM, per head: `dt = softplus(dt + dt_bias)` clamped to `time_step_limit`,
   `A = -exp(A_log)`, `h = exp(dt A) h + (dt B) x` (the state `h [H, P, N]`),
   `y = h C + D x`;
4. `out_proj(gated_rms_norm(y, z))` (`layers.norms.GatedRMSNorm`, groups of I / G).

NOTE (exactness): every token advances its sequence's state by the same recurrent arithmetic,
one token after the other, whether it comes in a long prefill, a chunk or a decode step (HF's
prefill uses the chunked SSD scan instead: the two agree to float rounding). The SSM runs on the
platform's kernel (`ops.ssm_scan_paged`: per sequence and head, in place on the cache) where it
has one, else in `Mamba2Mixer.scan`'s torch loop, whose `h C` sums the state dimension in a
fixed pairwise tree (a process uses one of the two for every step). The conv sums its taps
oldest first in float32. The transcendentals (softplus, exp) run one token's row at a time and
silu on the platform's one-formula kernel (`layers.activation`): torch's vector loops round a
tensor's tail elements differently, and where the tail falls depends on the batch. So a token's
bits do not depend on its batch, its chunking or recompute after preemption.

Tensor parallelism: each rank holds `H / N` heads and `G / N` groups (whole groups: their heads
and their B, C rows), so its conv channels, SSM, gated norm and state are all local; `out_proj`
sums over the ranks. With fewer groups than ranks (one, in Granite 4.0-H) each rank holds the
group its heads read (replicated) and the gated norm of a group spread over ranks sums its
squares over them (one all-reduce). ValueError, naming tensor_parallel_size, unless the heads
divide and the groups divide or are divided by the ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSpec, set_shard
from pagedserve.layers.norms import GatedRMSNorm
from pagedserve.layers.recurrent_state import KVPair, PagedState
from pagedserve.platforms import OpsUser


def mamba_group_part(n_groups: int, tp: TPContext) -> tuple[int, int]:
    """(groups this rank holds, its first group's index): `G / N` of them, or with fewer groups
    than ranks (Granite 4.0-H, Bamba and Falcon-H1 have one) the group of this rank's heads;
    ValueError, naming tensor_parallel_size, when neither divides the other."""
    n = tp.world_size
    if n_groups % n == 0:
        return n_groups // n, tp.rank * (n_groups // n)
    if n % n_groups:
        raise ValueError(f"mamba n_groups ({n_groups}) and tensor_parallel_size ({n}): one must divide the other")
    return 1, tp.rank // (n // n_groups)


def tree_sum(x: torch.Tensor) -> torch.Tensor:  # [..., N] -> [...]
    """The sum over the last dimension in a fixed pairwise order (zero-padded to a power of
    two): each output depends only on its own row, whatever the tensor's size."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


class Mamba2Mixer(OpsUser, nn.Module):
    """A Mamba2 mixer (see the module docstring) over a paged state; parameter names as HF's
    (`in_proj`, `conv1d.weight` `[C, 1, L]`, `conv1d.bias`, `dt_bias`, `A_log`, `D`, `norm`,
    `out_proj`). `page`: the values of one cache entry a token (this rank's).
    `forward(h [T, hidden], caches, metas)`: `caches` the layer's cache entries (K, V pairs),
    `metas` their attention metadata."""

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, state_size: int,
                 n_groups: int, conv_kernel: int, page: int, conv_bias: bool = True,
                 proj_bias: bool = False, activation: str = "silu", norm_eps: float = 1e-6,
                 time_step_limit: tuple[float, float] | None = None, norm_before_gate: bool = False,
                 tp: TPContext = SINGLE):
        super().__init__()
        if n_groups <= 0 or num_heads % n_groups:
            raise ValueError(f"mamba n_groups ({n_groups}) must divide the mamba heads ({num_heads})")
        if conv_kernel < 2:
            raise ValueError(f"the mamba conv kernel must span at least 2 positions, got {conv_kernel}")
        inter = num_heads * head_dim
        self.num_heads = tp.split(num_heads, "mamba heads")
        # this rank's groups: G / N of them, or, with fewer groups than ranks, the one group its
        # heads read (replicated on N / G ranks)
        self.n_groups, self.first_group = mamba_group_part(n_groups, tp)
        self.head_dim, self.state_size, self.conv_kernel = head_dim, state_size, conv_kernel
        self.inter = self.num_heads * head_dim  # this rank's I
        group_rows = self.n_groups * state_size  # this rank's G N
        self.conv_dim = self.inter + 2 * group_rows
        lo, hi = time_step_limit if time_step_limit is not None else (0.0, math.inf)
        self.time_step_limit = (float(lo), float(hi))
        # the checkpoint's fused projection: z, x (I each), B, C (G N each), dt (H); this rank's
        # rows of each part (`_shard`)
        self.in_proj = ColumnParallelLinear(
            hidden_size, [self.inter, self.inter, group_rows, group_rows, self.num_heads], proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(self.conv_dim)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        # a group's norm spans ranks when they share it: its sum of squares is all-reduced
        shared = (tp, self.first_group, n_groups) if n_groups < tp.world_size else None
        self.norm = GatedRMSNorm(self.inter, inter // n_groups if shared else self.inter // self.n_groups,
                                 norm_eps, norm_before_gate=norm_before_gate, shared_group=shared)
        self.out_proj = RowParallelLinear(inter, hidden_size, proj_bias, tp=tp)
        self.act = get_activation(activation)
        if tp.is_parallel:
            self._shard(tp, inter, n_groups * state_size)
        # per sequence: the conv's last L - 1 input rows (oldest first), the SSM state
        self.state = PagedState([(conv_kernel - 1, self.conv_dim),
                                 (self.num_heads, head_dim, state_size)], page)

    def _shard(self, tp: TPContext, inter: int, all_rows: int) -> None:
        """This rank's slices of the projection's parts, the conv channels (x, B and C alike),
        the heads and the norm."""
        r, n = tp.rank, self.n_groups * self.state_size
        x = (r * self.inter, (r + 1) * self.inter)
        b = self.first_group * self.state_size
        heads = (r * self.num_heads, (r + 1) * self.num_heads)
        proj = ShardSpec(0, (x, (inter + x[0], inter + x[1]), (2 * inter + b, 2 * inter + b + n),
                             (2 * inter + all_rows + b, 2 * inter + all_rows + b + n),
                             (2 * inter + 2 * all_rows + heads[0], 2 * inter + 2 * all_rows + heads[1])),
                         2 * inter + 2 * all_rows + self.num_heads * tp.world_size)
        set_shard(self.in_proj.weight, proj)
        set_shard(self.in_proj.bias, proj)
        conv = ShardSpec(0, (x, (inter + b, inter + b + n), (inter + all_rows + b, inter + all_rows + b + n)),
                         inter + 2 * all_rows)
        set_shard(self.conv1d.weight, conv)
        set_shard(self.conv1d.bias, conv)
        for p in (self.dt_bias, self.A_log, self.D):
            set_shard(p, ShardSpec(0, (heads,), self.num_heads * tp.world_size))
        set_shard(self.norm.weight, ShardSpec(0, (x,), inter))

    def bind(self, block_size: int, cache_dtype: torch.dtype) -> int:
        """Fit the state to the cache's blocks; returns the cache entries it takes."""
        return self.state.bind(block_size, cache_dtype)

    @property
    def num_entries(self) -> int:
        return self.state.num_entries

    def forward(self, h: torch.Tensor, caches: list[KVPair],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, xbc, dt = self.project(h).split([self.inter, self.conv_dim, self.num_heads], dim=-1)
        t, rows = h.shape[0], self.conv_kernel - 1
        qsl = metas[0].query_start_loc  # [S + 1]
        conv_state = self.state.gather(caches, metas, 0, rows * self.conv_dim)  # [S, (L-1) C]
        s = conv_state.shape[0]
        xbc, conv_state = self.conv(xbc, conv_state.view(s, rows, self.conv_dim), qsl.cpu())
        self.state.scatter(caches, metas, 0, conv_state.reshape(s, -1))
        groups = self.n_groups * self.state_size
        x, b, c = xbc.split([self.inter, groups, groups], dim=-1)  # [T, I], [T, G N] x 2
        x = x.reshape(t, self.num_heads, self.head_dim)  # [T, H, P]
        b = b.reshape(t, self.n_groups, self.state_size)  # [T, G, N]
        c = c.reshape(t, self.n_groups, self.state_size)  # [T, G, N]
        dt = self.time_steps(dt)  # [T, H]
        a = -torch.exp(self.A_log.float())  # [H]
        d = self.D.float()  # [H]
        start = self.state.offset(1)  # the SSM state's first value
        # the kernel reads and stores each (sequence, head) state in the cache in place
        flat, blocks, fresh = self.state.paged(caches, metas)
        y = self.ops.ssm_scan_paged(x, dt, a, b, c, d, flat, blocks, start, fresh, qsl)  # [T, H, P] or None
        if y is None:  # the torch loop
            numel = self.num_heads * self.head_dim * self.state_size
            ssm_state = self.state.gather(caches, metas, start, numel)  # [S, H P N]
            y, ssm_state = self.scan(x, b, c, dt, a, d, ssm_state.view(
                s, self.num_heads, self.head_dim, self.state_size), qsl.cpu())
            self.state.scatter(caches, metas, start, ssm_state.reshape(s, -1))
        y = y.reshape(t, self.inter)  # [T, I] fp32
        return self.out_proj(self.gated(y.to(h.dtype), gate))  # [T, hidden]

    def time_steps(self, dt: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H] fp32
        """`softplus(dt + dt_bias)` clamped to `time_step_limit`, one token's row at a time
        (exactness: see the module docstring)."""
        bias = self.dt_bias.float()
        lo, hi = self.time_step_limit
        rows = [F.softplus(row + bias) for row in dt.float().unbind(0)]  # T x [H]
        if lo > 0.0 or hi < math.inf:
            rows = [row.clamp(lo, hi) for row in rows]
        return torch.stack(rows) if rows else dt.float()

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, I + C + H]
        """The input projection (z, xBC, dt); a family may scale it (Falcon-H1's muP)."""
        return self.in_proj(h)

    def gated(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [T, I] x 2 -> [T, I]
        """The SSM output gated by z: the gated RMSNorm (Falcon-H1 may leave the norm out)."""
        return self.norm(y, gate)

    def conv(self, xbc: torch.Tensor, state: torch.Tensor,
             qsl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal depthwise conv + activation of every token (`xbc [T, C]`) from its
        sequence's previous L - 1 rows (`state [S, L-1, C]` before the step, then the step's
        own), oldest first, in float32; returns `([T, C], the new state [S, L-1, C])`."""
        t, s, k = xbc.shape[0], state.shape[0], self.conv_kernel - 1
        lens = qsl[1:] - qsl[:-1]  # [S]
        seq = torch.repeat_interleave(torch.arange(s), lens)  # [T]
        # each sequence's state rows then its tokens, one after the other: [T + S (L-1), C]
        tok_pos = torch.arange(t) + (seq + 1) * k  # [T]
        seg = qsl[:-1] + torch.arange(s) * k  # [S]: where each sequence's rows start
        state_pos = (seg[:, None] + torch.arange(k)).reshape(-1)  # [S (L-1)]
        ext = torch.empty(t + s * k, self.conv_dim, dtype=torch.float32, device=xbc.device)
        ext[tok_pos.to(xbc.device)] = xbc.float()
        ext[state_pos.to(xbc.device)] = state.reshape(s * k, self.conv_dim)
        w = self.conv1d.weight[:, 0, :].float()  # [C, L]
        first = (tok_pos - k).to(xbc.device)  # [T]
        acc = ext[first] * w[:, 0]  # [T, C]
        for j in range(1, k + 1):
            acc = acc + ext[first + j] * w[:, j]
        if self.conv1d.bias is not None:
            acc = acc + self.conv1d.bias.float()
        end = qsl[1:] + (torch.arange(s) + 1) * k  # [S]: past each sequence's last row
        new_state = ext[((end - k)[:, None] + torch.arange(k)).reshape(-1).to(xbc.device)]
        return self.act(acc), new_state.view(s, k, self.conv_dim)

    def scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
             a: torch.Tensor, d: torch.Tensor, state: torch.Tensor,
             qsl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The SSM in torch (where `kernels.cpu_recurrent.ssm_scan_paged` does not run) over
        every sequence's new tokens, one token position at a time (all sequences that have one
        at once): `x [T, H, P]`, `b`, `c` `[T, G, N]`, `dt [T, H]` (after softplus), `a`, `d`
        `[H]`, `state [S, H, P, N]`; returns `(y [T, H, P] with the D skip, the new state)`."""
        t, heads, p, n = x.shape[0], self.num_heads, self.head_dim, self.state_size
        per_group = heads // self.n_groups
        x = x.float()  # [T, H, P]
        b = b.float()[:, :, None, :].expand(t, self.n_groups, per_group, n).reshape(t, heads, n)
        c = c.float()[:, :, None, :].expand(t, self.n_groups, per_group, n).reshape(t, heads, n)
        decay = torch.stack([torch.exp(row * a) for row in dt.unbind(0)]) if t else dt  # [T, H]: exp(dt A)
        skip = x * d[:, None]  # [T, H, P]
        y = torch.empty(t, heads, p, dtype=torch.float32, device=x.device)
        starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]  # [S]
        state = state.float()
        longest = int(lens.max()) if len(lens) else 0
        for i in range(longest):
            live = (lens > i).nonzero().squeeze(1)  # [S_i]: the sequences with an i-th token
            every = len(live) == len(lens)
            rows = (starts[live] + i).to(x.device)  # [S_i]
            dbx = (dt[rows][:, :, None] * x[rows])[:, :, :, None] * b[rows][:, :, None, :]  # [S_i, H, P, N]
            h = state if every else state[live.to(x.device)]
            h = h * decay[rows][:, :, None, None] + dbx  # [S_i, H, P, N]
            y[rows] = tree_sum(h * c[rows][:, :, None, :]) + skip[rows]  # [S_i, H, P]
            if every:
                state = h
            else:
                state[live.to(x.device)] = h
        return y, state
