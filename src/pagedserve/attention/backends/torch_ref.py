"""Paged attention in plain PyTorch: the CPU path and the reference for faster kernels.

K/V caches are per layer, shaped `[num_blocks + 1, block_size, num_kv_heads, head_dim]` (the last
block is the never-written null block, see `AttentionMetadata.build`). The step's metadata is a
`torch_meta.TorchAttentionMetadata` (the common tensors and the host-side groups of its rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedserve.attention.backends.base import AttentionBackend
from pagedserve.attention.kv_dtype import as_bytes, is_fp8, to_cache
from pagedserve.attention.backends.torch_meta import AttentionGroup, TorchAttentionMetadata
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms import DEFAULT_OPS


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Store each new token's K and V at its slot, in the cache's dtype (fp8: rounded and
    saturated, `attention.kv_dtype.to_cache`)."""
    n, b, h, d = k_cache.shape
    as_bytes(k_cache.view(n * b, h, d)).index_copy_(
        0, slot_mapping, as_bytes(to_cache(key, k_cache.dtype)))
    as_bytes(v_cache.view(n * b, h, d)).index_copy_(
        0, slot_mapping, as_bytes(to_cache(value, v_cache.dtype)))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    meta: TorchAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    ops=None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] learned sink logits, or None
) -> torch.Tensor:  # [T, Hq, D]
    """Write the new K/V into the cache, then attend every query over its sequence's context read
    through the block tables (causal, optionally within a sliding window of keys; `softcap`: each
    scaled score s capped as `softcap * tanh(s / softcap)` before the softmax, Gemma 2's). `sinks`
    (gpt-oss): one learned logit per query head in each softmax's denominator, with no value
    (`softmax([scores, sink])` with the sink's weight dropped).

    `ops` (the platform's `LayerOps`; None: `platforms.DEFAULT_OPS`) may take the step on a
    kernel: the CPU platform's, when the compiled kernels are available (not disabled by
    `PAGEDSERVE_DISABLE_CPU_KERNELS=1`), sends float32 CPU queries and caches to the
    batch-invariant kernel (`kernels.cpu_fp32`), every token -- decode row or prompt chunk token
    -- attended alone over its own context, so its bits do not depend on chunking or on the rest
    of the step, and decode rows of bf16 CPU caches to `kernels.cpu_attention`. Everything else
    is plain torch (gather + SDPA).

    NOTE: soft-capped layers: the float32 kernel caps its scores itself (still every token alone,
    batch-invariant); the bf16 decode and prompt kernels do not cap, so those layers' bf16 steps
    run the torch paths here (decode rows one by one, prompt chunks with explicit scores: SDPA
    cannot cap).

    NOTE: with `sinks` every query token, decode row or prompt token alike, is attended alone
    over its own context, so its bits do not depend on chunking or on the rest of the step: on
    the float32 kernel, or (bf16 caches) the decode kernel with each prompt token taken as a
    decode row (`_sinks_on_decode_kernel`), else by `_attend_one`'s torch products (a Python
    loop over the tokens)."""
    if ops is None:
        ops = DEFAULT_OPS
    if meta.num_tokens and not isinstance(meta, TorchAttentionMetadata):
        raise ValueError(f"the torch backend needs its own metadata, with groups (built by "
                         f"TorchAttentionBackend.build_metadata), got {type(meta).__name__}")
    write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    if sinks is not None:
        o = ops.invariant_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, scale, sliding_window, softcap,
                                    sinks=sinks) if meta.num_tokens else None
        if o is not None:  # [T, Hq, D]
            return o
        o = None if softcap else _sinks_on_decode_kernel(query, k_cache, v_cache, meta, scale,
                                                         sliding_window, sinks, ops)
        if o is not None:  # [T, Hq, D]
            return o
        return _attend_with_sinks(query, k_cache, v_cache, meta, scale, sliding_window, sinks,
                                  softcap)
    if meta.num_tokens:
        o = ops.invariant_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, scale, sliding_window, softcap)
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
                                  sliding_window, ops, softcap)
            continue
        q = query if group.covers_all else query.index_select(0, group.out_tokens)  # [G, Hq, D]
        o = None if softcap else ops.decode_attention(q, k_cache, v_cache, group.block_tables,
                                                      group.seq_lens, scale, sliding_window)
        if o is None:
            o = _attend_decode_rows(q, flat_k, flat_v, group, scale, sliding_window, softcap)  # [G, Hq, D]
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
    group: AttentionGroup,  # the prompt group (with spans)
    scale: float,
    sliding_window: int | None,
    ops,  # the platform's LayerOps
    softcap: float | None = None,
) -> torch.Tensor:
    """Each member of a prompt group attends over its own context; returns `out` (allocated on
    the first call) with the members' rows written. On a kernel where the platform has one
    (`ops.prefill_attention`: bf16 on AVX2 / AVX512 CPUs, kernels/cpu_attention.py); else SDPA: a
    chunk whose context is just itself and fits the window causally over its new K/V, any other
    with an explicit causal (and window) mask; soft-capped scores (`softcap`) by explicit
    products (`_attend_capped`).

    With a sliding window a chunk reads only the keys its queries reach (from its first query's
    window on: blocks a sliding-window group gave back are never read), and a chunk longer
    than the window is attended in tiles of queries (`_prompt_pieces`).
    NOTE: the first key read is even and passed to the kernel (`key_start`): the AVX512-BF16
    kernel pairs keys from its context's start, the AMX kernel tiles them by 32 from the
    context's position 0 (a window column's context starts at a multiple of 32, `window_tail`),
    so that every chunking and trim gives the same bits."""
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
                k = to_cache(key[chunk_start + first : start + n], flat_k.dtype)  # [ctx - first, Hkv, D]
                v = to_cache(value[chunk_start + first : start + n], flat_v.dtype)
            else:
                slots = group.kv_slots[g, first:ctx]  # [ctx - first]
                k, v = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
            if is_fp8(k.dtype):
                # NOTE: fp8 blocks: the chunk's context widened in torch (exact: every fp8 value
                # is a bf16 / fp16 / fp32 value), then the model dtype's kernel or SDPA; the
                # context is a gathered copy here anyway (the decode kernels widen in place)
                k, v = k.to(query.dtype), v.to(query.dtype)
            qs = query[start : start + n]
            if softcap:  # positions relative to the first key read
                out[start : start + n] = _attend_capped(qs, k, v, ctx - first, scale,
                                                        sliding_window, softcap)
                continue
            # the kernel (bf16): causal and windowed by position, no mask tensor
            if ops.prefill_attention(qs, k, v, out[start : start + n], scale, sliding_window,
                                     first):
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
    group: AttentionGroup,  # the decode group
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [G, Hq, D]
    """Decode rows the compiled kernels did not take (no kernel for this dtype / CPU, or
    soft-capped scores): each row alone over exactly its own context (within the window),
    softmax(cap(q K^T * scale)) V in float32.
    NOTE: one row at a time, never padded to the batch's longest context, so a row's bits do not
    depend on the rows beside it. Plain products rather than SDPA: for one query its flash kernel
    costs ~0.5 ms a call on CPU (blocking set up for long queries)."""
    out = torch.empty_like(q)
    for i, ctx in enumerate(group.seq_lens.tolist()):
        first = max(0, ctx - sliding_window) if sliding_window else 0
        out[i] = _attend_one(q[i], flat_k, flat_v, group.kv_slots[i, first:ctx], scale, sinks,
                             softcap)
    return out


def _attend_one(
    q: torch.Tensor,  # [Hq, D] one query token
    flat_k: torch.Tensor,  # [N * B, Hkv, D]
    flat_v: torch.Tensor,
    slots: torch.Tensor,  # [n] its keys' cache slots
    scale: float,
    sinks: torch.Tensor | None,  # [Hq] or None
    softcap: float | None = None,
) -> torch.Tensor:  # [Hq, D] float32
    """One query token over the keys at `slots`: softmax(cap(q K^T * scale)) V in float32 (with a
    sink logit per head in the softmax when `sinks` is given, its weight dropped, as HF's
    gpt-oss). NOTE: the same ops on the same shapes for a token wherever it comes from (a decode
    row or a prompt token with sinks), so its bits agree."""
    num_heads, head_dim = q.shape
    hkv = flat_k.shape[1]
    k = flat_k.index_select(0, slots).float().permute(1, 2, 0)  # [Hkv, D, n]
    v = flat_v.index_select(0, slots).float().transpose(0, 1)  # [Hkv, n, D]
    qi = q.float().view(hkv, num_heads // hkv, head_dim)  # [Hkv, g, D]
    s = torch.bmm(qi, k).mul_(scale)  # [Hkv, g, n]
    if softcap:
        s = s.div_(softcap).tanh_().mul_(softcap)
    if sinks is None:
        p = torch.softmax(s, dim=-1)  # [Hkv, g, n]
    else:
        sink = sinks.float().view(hkv, num_heads // hkv, 1)  # [Hkv, g, 1]
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]  # [Hkv, g, n]
    return torch.bmm(p, v).view(num_heads, head_dim)  # [Hq, D]


def _sinks_on_decode_kernel(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D] the step's K/V written
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor,  # [Hq]
    ops,
) -> torch.Tensor | None:  # [T, Hq, D], or None: the platform has no such kernel here
    """Every query token of the step as one decode row of the platform's decode kernel (with
    the sinks; `AttentionMetadata.token_rows`).
    NOTE: a prompt token and the same token decoded take the same call on the same context, so
    recompute, chunking and batch composition change no bit."""
    tables, lens = meta.token_rows()  # [T, max_blocks], [T]: built once a step
    return ops.decode_attention(query, k_cache, v_cache, tables, lens, scale, sliding_window,
                                sinks=sinks)


def _attend_with_sinks(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D] the step's K/V written
    v_cache: torch.Tensor,
    meta: TorchAttentionMetadata,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor,  # [Hq]
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Every query token alone over its own context (`_attend_one`), prompt tokens and decode
    rows alike (see `paged_attention`'s NOTE on sinks)."""
    n, b, hkv, head_dim = k_cache.shape
    flat_k = k_cache.view(n * b, hkv, head_dim)
    flat_v = v_cache.view(n * b, hkv, head_dim)
    out = torch.empty_like(query)
    for group in meta.groups:
        if not group.is_prompt:
            q = query if group.covers_all else query.index_select(0, group.out_tokens)
            o = _attend_decode_rows(q, flat_k, flat_v, group, scale, sliding_window, softcap, sinks)
            if group.covers_all:
                return o
            out.index_copy_(0, group.out_tokens, o)
            continue
        for g, (start, count, ctx) in enumerate(group.spans):
            for i in range(count):
                end = ctx - count + i + 1  # this token's context length
                first = max(0, end - sliding_window) if sliding_window else 0
                out[start + i] = _attend_one(query[start + i], flat_k, flat_v,
                                             group.kv_slots[g, first:end], scale, sinks, softcap)
    return out


def _attend_capped(
    q: torch.Tensor,  # [n, Hq, D] a chunk's queries, the last n of its ctx positions
    k: torch.Tensor,  # [ctx, Hkv, D]
    v: torch.Tensor,  # [ctx, Hkv, D]
    ctx: int,
    scale: float,
    sliding_window: int | None,
    softcap: float,
) -> torch.Tensor:  # [n, Hq, D] in q's dtype
    """A prompt chunk's attention with soft-capped scores, as HF's eager attention computes it:
    `s = (q K^T) * scale`, `softcap * tanh(s / softcap)`, causal (window) mask, softmax in
    float32, times V."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1).permute(1, 2, 0)  # [Hq, D, ctx]
    v = v.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
    s = torch.bmm(q.transpose(0, 1), k) * scale  # [Hq, n, ctx]
    s = torch.tanh(s / softcap) * softcap
    q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # [1, ctx]
    allowed = k_pos <= q_pos  # [n, ctx]
    if sliding_window:
        allowed = allowed & (q_pos - k_pos < sliding_window)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)  # [Hq, n, ctx]
    return torch.bmm(p, v).transpose(0, 1)  # [n, Hq, D]


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
        k, v = as_bytes(k), as_bytes(v)  # fp8: no index_copy_ in torch (the same bytes)
        k.index_copy_(0, dst, k.index_select(0, src))
        v.index_copy_(0, dst, v.index_select(0, src))


class TorchAttentionBackend(AttentionBackend):
    """The torch backend (any device): metadata with host-side groups
    (`torch_meta.TorchAttentionMetadata`), `paged_attention` with the platform's kernels (`ops`)
    where they apply."""

    name = "torch"
    metadata_class = TorchAttentionMetadata

    def forward(self, query, key, value, kv_cache, meta, scale, sliding_window=None, softcap=None,
                *, sinks=None):
        return paged_attention(query, key, value, kv_cache[0], kv_cache[1], meta, scale,
                               sliding_window, ops=self.ops, softcap=softcap, sinks=sinks)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def copy_blocks(self, kv_caches, src, dst) -> None:
        copy_blocks(kv_caches, src, dst)
