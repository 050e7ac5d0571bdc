"""Paged attention in Triton: the CUDA backend (same functions and signatures as `torch_ref`).

Kernels:
- `write_kv`: reshape-and-cache, one program per new token (any block size; slot -1 is skipped,
  so that padded rows of a CUDA-graph batch write nothing).
- `paged_attention`: one kernel over a mixed batch of prompt chunks and decode tokens. A program
  owns one KV head and a tile of `BLOCK_M` query rows, where a row is a (query token, query head of
  that KV head's group) pair: grouped-query heads share every K/V tile they load, and decode rows
  (one token each) still fill the tile when the group is large. Keys are read through the block
  table one position at a time (block = pos // block_size), so any block size works. fp32 online
  softmax (base 2), causal mask where a sequence's queries are the last `query_len` positions of
  its `seq_len`, optional sliding window (key allowed iff q_pos - k_pos < window), optional score
  soft-capping (`softcap * tanh(s / softcap)`, Gemma 2; tanh from exp, as triton has none).
  Split-K (flash-decoding): with `num_splits > 1`, each (query tile, KV head) splits its key range
  into `num_splits` parts written as partial (max, sum, unnormalised out) in fp32, then
  `_reduce_kernel` combines them. The heuristic turns it on for decode-only batches of few
  (sequence, KV head) pairs over long contexts; `num_splits=` (or `meta.num_splits`) forces it.
- The step's metadata is a `TritonAttentionMetadata`: the common tensors (the kernels read the
  block tables, lengths and query offsets directly: no host-side groups) and `num_splits`.
- `copy_blocks`: whole-block copies inside the device pool (copy-on-write).

Under `TRITON_INTERPRET=1` (set before triton is imported) the kernels run on CPU tensors; that is
how the tests check them against `torch_ref` without a GPU.

NOTE: the interpreter (triton 3.9) computes bf16 arithmetic and `tl.dot` on bf16 wrongly (numpy has
no bf16), while loads, stores and casts are right. So under the interpreter the kernels upcast to
fp32 before every dot (`DOT_FP32`), which also is what fp32 caches use on the GPU ("ieee"
precision, no TF32); bf16/fp16 caches on the GPU feed the tensor cores in their own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.attention.backends.base import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(-inf - _NEG_BIG) == 0, no NaN


# ----------------------------------------------------------------------------------------------
# metadata


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """The Triton backend's metadata (`TritonAttentionBackend.build_metadata`): the common
    tensors, every one of which a CUDA graph can capture, and the split-K count."""

    # split-K parts (`AttentionBatch.num_splits`; fixed for CUDA graphs); None: `choose_num_splits`
    num_splits: int | None = None


# ----------------------------------------------------------------------------------------------
# write_kv


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded row (CUDA graphs): nothing to store
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)  # [H, D]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64 (-1: skip the row)
) -> None:
    """Store each new token's K and V at its slot (cast to the cache dtype)."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != (num_heads, head_dim):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    # Cast in torch (round-to-nearest-even, as torch_ref does): the interpreter's in-kernel
    # fp32 -> bf16 cast truncates, and in the model the dtypes match anyway.
    key = _last_dim_contiguous(key.to(k_cache.dtype))
    value = _last_dim_contiguous(value.to(v_cache.dtype))
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ----------------------------------------------------------------------------------------------
# paged attention


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile `q_block`: sequence i's tiles start at
    `query_start_loc[i] // BLOCK_Q + i` (binary search over that increasing sequence)."""
    # NOTE: tensors from the start: an int argument equal to 1 arrives as a constexpr, which may
    # not change type when the loop reassigns it.
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "window", "num_splits", "softcap"])
def _attn_kernel(
    out_ptr,  # [T, Hq, D] (no split) or fp32 [T, Hq, S, D] partial outputs (split)
    m_ptr, l_ptr,  # fp32 [T, Hq, S] running max / sum per split (split only)
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, num_seqs, window, num_splits, block_size, softcap,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:  # spare tile of the grid's upper bound
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_start = seq_len - q_len  # position of the sequence's first query token

    # Rows: (query token, query head within the group) pairs.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // GROUP  # [M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [M] query head
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)  # [M]
    q_pos = ctx_start + q_idx  # [M] absolute position
    tok = (q_start + q_idx).to(tl.int64)  # [M] flat token row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys this tile needs: [lo, hi), hi past its last query, lo at its first query's window.
    first_q = ctx_start + local_block * BLOCK_Q
    hi = tl.minimum(seq_len, first_q + BLOCK_Q)
    lo = first_q * 0
    if USE_WINDOW:
        lo = tl.maximum(first_q - window + 1, 0)
    num_tiles = tl.cdiv(hi - lo, BLOCK_N)
    tile_begin = num_tiles * 0
    tile_end = num_tiles
    if SPLIT:
        per_split = tl.cdiv(num_tiles, num_splits)
        tile_begin = tl.minimum(split * per_split, num_tiles)
        tile_end = tl.minimum(tile_begin + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_begin, tile_end):
        k_pos = lo + t * BLOCK_N + offs_n  # [N]
        k_ok = k_pos < hi
        # NOTE: masked lanes read block 0 offset 0 only as an address; their loads are masked.
        blk = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)  # [N]
        off = (k_pos % block_size).to(tl.int64)  # [N]
        k = tl.load(
            k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks
            + kv_head * stride_kh + d[:, None],
            mask=k_ok[None, :] & d_ok[:, None], other=0.0,
        )  # [D, N]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")  # [M, N]
        else:
            s = tl.dot(q, k)  # [M, N]
        if USE_SOFTCAP:  # softcap * tanh(s * scale / softcap), then to base 2
            x = s * (scale_log2 / (1.4426950408889634 * softcap))
            s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
        else:
            s = s * scale_log2
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [M, N]
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
        alpha = tl.exp2(m_i - m_new)  # [M]
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
            + kv_head * stride_vh + d[None, :],
            mask=k_ok[:, None] & d_ok[None, :], other=0.0,
        )  # [N, D]
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")  # [M, D]
        else:
            pv = tl.dot(p.to(v.dtype), v)  # [M, D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    store_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # Partials are [T, Hq, S, (D)] contiguous fp32.
        part = (tok * NUM_Q_HEADS + head) * num_splits + split  # [M]
        tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=store_mask)
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=store_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr, acc_ptr, m_ptr, l_ptr,  # out [T, Hq, D]; acc fp32 [T, Hq, S, D]; m, l fp32 [T, Hq, S]
    num_splits, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    base = (t * NUM_Q_HEADS + h) * num_splits
    m = tl.load(m_ptr + base + s, mask=s_ok, other=_NEG_BIG)  # [S]
    l_part = tl.load(l_ptr + base + s, mask=s_ok, other=0.0)  # [S]
    w = tl.exp2(m - tl.max(m, 0))  # [S]
    acc = tl.load(
        acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0,
    )  # [S, D]
    total = tl.sum(l_part * w, 0)
    total = tl.where(total > 0, total, 1.0)
    o = tl.sum(acc * w[:, None], 0) / total  # [D]
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# Split-K heuristic: only decode-only batches that leave most of the GPU idle, over long contexts.
SPLIT_MIN_SEQ_LEN = 1024  # shorter contexts: one pass is cheap enough
SPLIT_TARGET_PROGRAMS = 256  # ~2 waves of programs on a 132-SM H200
SPLIT_MIN_KEYS = 256  # keep at least this many keys per split
SPLIT_MAX = 64


def choose_num_splits(meta: TritonAttentionMetadata, num_kv_heads: int) -> int:
    """How many key-range splits `paged_attention` uses for this step (1 = no split-K)."""
    if meta.num_splits is not None:
        return meta.num_splits
    if meta.max_query_len != 1 or meta.max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1
    programs = meta.seq_lens.shape[0] * num_kv_heads
    if programs >= SPLIT_TARGET_PROGRAMS // 2:
        return 1
    splits = min(SPLIT_TARGET_PROGRAMS // programs, meta.max_seq_len // SPLIT_MIN_KEYS, SPLIT_MAX)
    # Powers of two only, so that the reduce kernel compiles for few distinct split counts.
    return 1 << int(math.log2(max(splits, 1)))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    meta: TritonAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Write the new K/V into the cache, then attend every query over its sequence's context read
    through the block tables (causal, optionally within a sliding window of keys; `softcap`:
    scaled scores capped as `softcap * tanh(s / softcap)`).

    `num_splits`: split-K parts (1 = off); None = `meta.num_splits`, else the heuristic
    (`choose_num_splits`). The grid depends only on T, the number of sequences and `num_splits`,
    never on lengths, so a fixed `num_splits` keeps the launch CUDA-graph safe.
    """
    write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if num_tokens != meta.num_tokens:
        raise ValueError(f"query has {num_tokens} tokens, the metadata {meta.num_tokens}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if num_splits is None:
        num_splits = choose_num_splits(meta, num_kv_heads)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = query.new_empty(num_tokens, num_heads, head_dim)  # [T, Hq, D]
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    interpreting = _interpreting()
    dot_fp32 = interpreting or k_cache.dtype == torch.float32
    q = _last_dim_contiguous(query if dot_fp32 else query.to(k_cache.dtype))
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Rows per tile: 16 (the smallest dot) for decode; taller tiles for prompt chunks.
    block_m = 16
    if not interpreting and meta.max_query_len * group >= 64:
        block_m = 64 if block_d <= 128 else 32
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group  # query tokens per tile
    block_n = 64 if (interpreting or block_d <= 64) else 32
    # NOTE: sequence i's tiles start at query_start_loc[i] // block_q + i (see _find_seq); this
    # bound covers them all whatever the query lengths, without reading them on the host.
    num_q_blocks = num_tokens // block_q + num_seqs
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=query.device)  # [T, Hq, S, D]
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                             device=query.device)  # [T, Hq, S]
        part_l = torch.empty_like(part_m)  # [T, Hq, S]
        target, m_buf, l_buf = part_out, part_m, part_l
    else:
        target, m_buf, l_buf = out, out, out  # m/l unused without split
    bt = meta.block_tables
    _attn_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        target, m_buf, l_buf,
        q, k_cache, v_cache,
        bt, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, num_seqs, sliding_window or 0, num_splits, k_cache.shape[1],
        float(softcap or 1.0),
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        NUM_Q_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLIT=split, USE_WINDOW=bool(sliding_window), DOT_FP32=dot_fp32,
        USE_SOFTCAP=bool(softcap),
        num_warps=4 if block_d <= 128 else 8,
    )
    if split:
        _reduce_kernel[(num_tokens, num_heads)](
            out, part_out, part_m, part_l,
            num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


# ----------------------------------------------------------------------------------------------
# copy_blocks


@triton.jit
def _copy_blocks_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, block_numel, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    tl.store(k_ptr + dst * block_numel + offs, tl.load(k_ptr + src * block_numel + offs, mask=mask), mask=mask)
    tl.store(v_ptr + dst * block_numel + offs, tl.load(v_ptr + src * block_numel + offs, mask=mask), mask=mask)


def copy_blocks(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer 2 x [N, B, Hkv, D]
    src: torch.Tensor,  # [P] int64 source blocks
    dst: torch.Tensor,  # [P] int64 destination blocks
) -> None:
    """Copy whole blocks `src[i] -> dst[i]` in every layer's K and V cache (copy-on-write).

    NOTE: no block may be both a source and a destination in one call (copy-on-write targets are
    fresh blocks); the copies of a call run in parallel.
    """
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-D")
    if src.numel() == 0:
        return
    chunk = 1024
    for k_cache, v_cache in kv_caches:
        _check_cache(k_cache, v_cache)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("copy_blocks needs contiguous caches")
        block_numel = k_cache[0].numel()
        _copy_blocks_kernel[(src.numel(), triton.cdiv(block_numel, chunk))](
            k_cache, v_cache, src, dst, block_numel, BLOCK=chunk,
        )


class TritonAttentionBackend(AttentionBackend):
    """The Triton backend (CUDA; CPU tensors under TRITON_INTERPRET=1): metadata without
    host-side groups (`TritonAttentionMetadata`: every tensor of it can be captured in a CUDA
    graph), the kernels above."""

    name = "triton"
    metadata_class = TritonAttentionMetadata
    supports_graphs = True

    def _build(self, batch, block_tables, seq_lens) -> TritonAttentionMetadata:
        meta = super()._build(batch, block_tables, seq_lens)
        meta.num_splits = batch.num_splits
        return meta

    def forward(self, query, key, value, kv_cache, meta, scale, sliding_window=None, softcap=None,
                *, sinks=None):
        if sinks is not None:
            raise NotImplementedError("attention sinks (gpt-oss) on the Triton backend; use "
                                      "attention_backend='torch'")
        return paged_attention(query, key, value, kv_cache[0], kv_cache[1], meta, scale,
                               sliding_window, softcap=softcap)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def copy_blocks(self, kv_caches, src, dst) -> None:
        copy_blocks(kv_caches, src, dst)


# ----------------------------------------------------------------------------------------------
# helpers


def _interpreting() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at import time.
    return type(_attn_kernel).__name__ == "InterpretedFunction"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(
            f"caches must both be [N, B, Hkv, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in the head dimension")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
