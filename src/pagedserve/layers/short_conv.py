"""A gated short convolution (LFM2's `Lfm2ShortConv`) whose state lives in the paged KV cache.

`B, C, x = in_proj(h)` (each `[T, channels]`); `y = out_proj(C * conv(B * x))`, where `conv` is a
causal depthwise convolution over the last `L` positions (`conv_L_cache`, 3 in LFM2): channel c of
token p is `sum_j w[c, j] * bx[p - (L - 1) + j, c]` (+ bias), positions before 0 reading zeros.

The convolution's state is just the last `L - 1` rows of `bx`. So we keep `bx` of every token in
the KV cache as a *sliding-window layer of window L* (`core.kv_spec.SlidingWindowSpec`): each
token's row is written at its slot as attention writes K and V, and a token reads the previous
`L - 1` rows of its sequence through its block table. Everything the engine does to KV then holds
for the state unchanged and exactly: blocks out of the window go back to the pool, chunked
prefill, preemption by swap or recompute, copy-on-write forks (n > 1, beam search), prefix
caching (a hit's window blocks hold the rows the next token reads) and speculative decoding (a
rejected draft's row is rewritten by the next step).

A row of `channels` values spans `cache_entries(channels, page)` cache entries of the attention
layers' page shape (`page` = (K and V) x heads x head size values a token): the pool's blocks are
of one size, so the state takes the attention pages' shape; the last entry is zero-padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.kv_dtype import as_bytes, to_cache
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSpec, set_shard


def cache_entries(channels: int, page: int) -> int:
    """How many cache entries (pages of `page` values a token) a row of `channels` takes."""
    return -(-channels // page)


class ShortConv(nn.Module):
    """LFM2's gated short convolution (parameter names as HF's: `in_proj`, `conv.weight`
    `[C, 1, L]`, `out_proj`, biases with `bias`) over a paged state (see the module docstring);
    `page`: the values of one cache entry a token (this rank's, under tensor parallelism).
    `forward(h [T, H], caches, metas)`: `caches` the layer's cache entries (K, V pairs),
    `metas` each entry's attention metadata."""

    def __init__(self, hidden_size: int, kernel_size: int, *, bias: bool, page: int,
                 tp: TPContext = SINGLE):
        super().__init__()
        # Under tensor parallelism each rank holds a slice of the channels (of B, C and x alike,
        # and of the depthwise conv), its state rows only those; out_proj sums over the ranks.
        self.channels = tp.split(hidden_size, "hidden_size")
        self.kernel_size, self.page = kernel_size, page
        self.in_proj = ColumnParallelLinear(hidden_size, [hidden_size] * 3, bias, tp=tp)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias, tp=tp)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(self.channels, 1, kernel_size))
        self.conv.bias = nn.Parameter(torch.empty(self.channels)) if bias else None
        if tp.is_parallel:
            start = tp.rank * self.channels
            spec = ShardSpec(0, ((start, start + self.channels),), hidden_size)
            set_shard(self.conv.weight, spec)
            set_shard(self.conv.bias, spec)

    @property
    def num_entries(self) -> int:
        return cache_entries(self.channels, self.page)

    def forward(
        self,
        h: torch.Tensor,  # [T, H]
        caches: list[tuple[torch.Tensor, torch.Tensor]],  # per entry: [N, B, Hkv, D] x 2
        metas: list[AttentionMetadata],
    ) -> torch.Tensor:  # [T, H]
        b, c, x = self.in_proj(h).chunk(3, dim=-1)  # [T, C] each
        bx = b * x  # [T, C]
        rows = self._state_rows(bx, caches, metas)  # L x [T, C]: positions p - L + 1 .. p
        w = self.conv.weight[:, 0, :].float()  # [C, L]
        # NOTE: one fixed order for every token (oldest position first, in float32), whatever
        # the batch: the same token gives the same bits in any step (the exactness rule).
        acc = rows[0].float() * w[:, 0]  # [T, C]
        for j in range(1, self.kernel_size):
            acc = acc + rows[j].float() * w[:, j]
        if self.conv.bias is not None:
            acc = acc + self.conv.bias.float()
        return self.out_proj(c * acc.to(c.dtype))  # [T, H]

    def _state_rows(self, bx: torch.Tensor, caches, metas) -> list[torch.Tensor]:
        """Write each token's `bx` row at its slot, then read back, for every token, the rows of
        its sequence at lags L - 1 .. 1 (zeros before position 0) and its own: `L x [T, C]`."""
        t, page, lags = bx.shape[0], self.page, self.kernel_size - 1
        half, width = page // 2, self.num_entries * page
        padded = bx if width == self.channels else F.pad(bx, (0, width - self.channels))  # [T, E * P]
        parts = []
        for e, ((k_cache, v_cache), meta) in enumerate(zip(caches, metas)):
            slots, valid = lag_slots(meta, lags)  # [T * lags], [T, lags, 1]
            got = []
            for cache, values in zip((k_cache, v_cache), padded[:, e * page:(e + 1) * page].split(half, -1)):
                flat = as_bytes(cache.view(-1, half))  # [(N+1) * B, P / 2]
                flat.index_copy_(0, meta.slot_mapping, as_bytes(to_cache(values, cache.dtype)))
                got.append(flat.index_select(0, slots).view(cache.dtype))  # [T * lags, P / 2]
            rows = torch.cat(got, dim=-1).view(t, lags, page).to(bx.dtype)  # [T, lags, P]
            parts.append(rows.masked_fill(~valid, 0))
        lagged = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [T, lags, E * P]
        if width != self.channels:
            lagged = lagged[..., : self.channels]
        return [lagged[:, j] for j in range(lags)] + [bx]  # oldest first, then the token's own


def lag_slots(meta: AttentionMetadata, lags: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token of the step, the slots of its sequence's previous `lags` positions, oldest
    first (`[T * lags]`; position 0's block where a position is before 0), and which exist
    (`[T, lags, 1]`). NOTE: computed once per step and metadata (every conv entry of a column
    reads the same), kept on the metadata as `token_rows` is."""
    key = f"_short_conv_lags_{lags}"
    cached = meta.__dict__.get(key)
    if cached is None:
        table, lens = meta.token_rows()  # [T, max_blocks], [T] (context = position + 1)
        bs = meta.block_size
        back = torch.arange(lags, 0, -1, device=lens.device)  # [lags]: L - 1 .. 1
        pos = (lens - 1)[:, None] - back  # [T, lags]
        valid = (pos >= 0)[..., None]  # [T, lags, 1]
        pos = pos.clamp(min=0)
        slots = table.gather(1, pos // bs) * bs + pos % bs  # [T, lags]
        cached = (slots.reshape(-1), valid)
        meta.__dict__[key] = cached
    return cached
