"""Paged attention in plain PyTorch: the CPU path and the reference for faster kernels.

K/V caches are per layer, shaped `[num_blocks + 1, block_size, num_kv_heads, head_dim]` (the last
block is the never-written null block, see `AttentionMetadata.build`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedserve.attention.backends.base import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms import DEFAULT_OPS


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Store each new token's K and V at its slot."""
    n, b, h, d = k_cache.shape
    k_cache.view(n * b, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(n * b, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    ops=None,
) -> torch.Tensor:  # [T, Hq, D]
    """Write the new K/V into the cache, then attend every query over its sequence's context read
    through the block tables (causal, optionally within a sliding window of keys).

    `ops` (the platform's `LayerOps`; None: `platforms.DEFAULT_OPS`) may take the step on a
    kernel: the CPU platform's, when the compiled kernels are available (not disabled by
    `PAGEDSERVE_DISABLE_CPU_KERNELS=1`), sends float32 CPU queries and caches to the
    batch-invariant kernel (`kernels.cpu_fp32`), every token -- decode row or prompt chunk token
    -- attended alone over its own context, so its bits do not depend on chunking or on the rest
    of the step, and decode rows of bf16 CPU caches to `kernels.cpu_attention`. Everything else
    is plain torch (gather + SDPA)."""
    if ops is None:
        ops = DEFAULT_OPS
    if meta.num_tokens and not meta.groups:
        raise ValueError("the torch backend needs metadata built with groups (backend='torch')")
    write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    if meta.num_tokens:
        o = ops.invariant_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, sliding_window)
        if o is not None:  # [T, Hq, D]
            return o
    num_tokens, num_heads, head_dim = query.shape
    n, b, hkv, _ = k_cache.shape
    flat_k = k_cache.view(n * b, hkv, head_dim)
    flat_v = v_cache.view(n * b, hkv, head_dim)
    out: torch.Tensor | None = None  # [T, Hq, D] once a group needs it (a decode-only step may not)
    for group in meta.groups:
        if group.is_prompt:
            # Prompt chunks one by one, unpadded: no padding to the longest, and a causal kernel
            # skips the masked half (docs/benchmarks.md, "Measurements behind design choices").
            out = _attend_prompts(out, query, key, value, flat_k, flat_v, group, scale,
                                  sliding_window, ops)
            continue
        q = query if group.covers_all else query.index_select(0, group.out_tokens)  # [G, Hq, D]
        o = ops.decode_attention(q, k_cache, v_cache, group.block_tables, group.seq_lens, scale,
                             sliding_window)
        if o is None:
            o = _attend_decode_rows(q, flat_k, flat_v, group, scale, sliding_window)  # [G, Hq, D]
        if group.covers_all:  # a decode-only step: o is the whole output, in order
            return o
        out = _scatter(out, num_tokens, group.out_tokens, o)
    return out if out is not None else query.new_empty(num_tokens, num_heads, head_dim)


# A sliding-window layer's prompt chunk longer than this (and than its window) is attended in
# tiles of queries, each over its own window of keys only: compute follows memory (a chunk of n
# costs ~ n * (tile + window), not n * n).
_WINDOW_TILE = 256


def _prompt_pieces(start: int, n: int, ctx: int, window: int | None):
    """(flat start, query length, context length) of the pieces a prompt chunk is attended in:
    itself, or with a sliding window shorter than it, tiles of queries."""
    if not window or n <= max(window, _WINDOW_TILE):
        return ((start, n, ctx),)
    tile = max(window, _WINDOW_TILE)
    before = ctx - n
    return tuple((start + a, min(tile, n - a), before + a + min(tile, n - a))
                 for a in range(0, n, tile))


def _attend_prompts(
    out: torch.Tensor | None,  # [T, Hq, D] or None
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    flat_k: torch.Tensor,  # [N * B, Hkv, D] the cache, new K/V already written
    flat_v: torch.Tensor,
    group,  # AttentionGroup with spans
    scale: float,
    sliding_window: int | None,
    ops,  # the platform's LayerOps
) -> torch.Tensor:
    """Each member of a prompt group attends over its own context; returns `out` (allocated on
    the first call) with the members' rows written. On a kernel where the platform has one
    (`ops.prefill_attention`: bf16 on AVX2 / AVX512 CPUs, kernels/cpu_attention.py); else SDPA: a
    chunk whose context is just itself and fits the window causally over its new K/V, any other
    with an explicit causal (and window) mask.

    With a sliding window a chunk reads only the keys its queries reach (from its first query's
    window on: blocks a sliding-window group gave back are never read), and a chunk longer
    than the window is attended in tiles of queries (`_prompt_pieces`).
    NOTE: the first key read is even: the kernel pairs keys from its context's start, and an
    even offset keeps the pairs (hence the bits) of every chunking the same."""
    num_tokens, num_heads, head_dim = query.shape
    if out is None:
        out = query.new_empty(num_tokens, num_heads, head_dim)
    gqa = key.shape[1] != num_heads
    for g, span in enumerate(group.spans):
        chunk_start, chunk_n, chunk_ctx = span
        for start, n, ctx in _prompt_pieces(*span, sliding_window):
            # first key any query of the piece reads (even, see above)
            first = (max(0, ctx - n - sliding_window + 1) & ~1) if sliding_window else 0
            # NOTE: a piece with nothing cached before it reads its own K/V, rounded to the
            # cache's dtype as reading them back from it would; any other reads its context
            # through its slots.
            if chunk_ctx == chunk_n:  # (positions 0 .. ctx - 1 are all the chunk's own)
                k = key[chunk_start + first : start + n].to(flat_k.dtype)  # [ctx - first, Hkv, D]
                v = value[chunk_start + first : start + n].to(flat_v.dtype)
            else:
                slots = group.kv_slots[g, first:ctx]  # [ctx - first]
                k, v = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
            qs = query[start : start + n]
            # the kernel (bf16): causal and windowed by position, no mask tensor
            if ops.prefill_attention(qs, k, v, out[start : start + n], scale, sliding_window):
                continue
            q = qs.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            span_keys = ctx - first
            if span_keys == n and (not sliding_window or n <= sliding_window):
                mask, causal = None, True
            else:
                q_pos = torch.arange(span_keys - n, span_keys, device=q.device).unsqueeze(1)
                k_pos = torch.arange(span_keys, device=q.device).unsqueeze(0)  # [1, ctx - first]
                mask, causal = k_pos <= q_pos, False  # [n, ctx - first]
                if sliding_window:
                    mask = mask & (q_pos - k_pos < sliding_window)
            k = k.to(query.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx - first, D]
            v = v.to(query.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               scale=scale, enable_gqa=gqa)  # [1, Hq, n, D]
            out[start : start + n] = o[0].transpose(0, 1)
    return out


def _attend_decode_rows(
    q: torch.Tensor,  # [G, Hq, D] one query per member
    flat_k: torch.Tensor,  # [N * B, Hkv, D] the cache, new K/V already written
    flat_v: torch.Tensor,
    group,  # the decode AttentionGroup
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [G, Hq, D]
    """Decode rows the compiled kernels did not take (no kernel for this dtype / CPU): each row
    alone over exactly its own context (within the window), softmax(q K^T * scale) V in float32.
    NOTE: one row at a time, never padded to the batch's longest context, so a row's bits do not
    depend on the rows beside it. Plain products rather than SDPA: for one query its flash kernel
    costs ~0.5 ms a call on CPU (blocking set up for long queries)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    hkv = flat_k.shape[1]
    group_size = num_heads // hkv
    out = torch.empty_like(q)
    for i, ctx in enumerate(group.seq_lens.tolist()):
        first = max(0, ctx - sliding_window) if sliding_window else 0
        slots = group.kv_slots[i, first:ctx]  # [n]
        k = flat_k.index_select(0, slots).float().permute(1, 2, 0)  # [Hkv, D, n]
        v = flat_v.index_select(0, slots).float().transpose(0, 1)  # [Hkv, n, D]
        qi = q[i].float().view(hkv, group_size, head_dim)  # [Hkv, g, D]
        p = torch.softmax(torch.bmm(qi, k).mul_(scale), dim=-1)  # [Hkv, g, n]
        out[i] = torch.bmm(p, v).view(num_heads, head_dim)  # [Hq, D], rounded to q's dtype
    return out


def _scatter(out: torch.Tensor | None, num_tokens: int, rows: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """`out[rows] = o`, allocating `out` ([T, Hq, D]) on the first call (when it is None)."""
    if out is None:
        out = o.new_empty(num_tokens, *o.shape[1:])
    return out.index_copy_(0, rows, o)


def copy_blocks(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer 2 x [N, B, Hkv, D]
    src: torch.Tensor,  # [P] int64 source blocks
    dst: torch.Tensor,  # [P] int64 destination blocks
) -> None:
    """Copy whole blocks `src[i] -> dst[i]` in every layer's K and V cache (copy-on-write)."""
    for k, v in kv_caches:
        k.index_copy_(0, dst, k.index_select(0, src))
        v.index_copy_(0, dst, v.index_select(0, src))


class TorchAttentionBackend(AttentionBackend):
    """The torch backend (any device): metadata with host-side groups, `paged_attention` with
    the platform's kernels (`ops`) where they apply."""

    name = "torch"

    def forward(self, query, key, value, kv_cache, meta, scale, sliding_window=None):
        return paged_attention(query, key, value, kv_cache[0], kv_cache[1], meta, scale,
                               sliding_window, ops=self.ops)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def copy_blocks(self, kv_caches, src, dst) -> None:
        copy_blocks(kv_caches, src, dst)
