"""Test-side batch-invariant float32 ops, so that one request's logits do not depend on what else
is in its step (the stress harness compares outputs EXACTLY across cache configurations).

Why: on CPU, torch's float32 `F.linear` (MKL sgemm) gives a row a result that depends on M, the
number of rows in the product (M = 1 takes a GEMV path; M = 2, 3, ... differ again, last bits), and
`F.scaled_dot_product_attention` gives a query a result that depends on how many queries and
(padded) keys it is batched with. A step's M is the number of tokens scheduled with the request, so
the same request differs in the last bits between a crowded step and a quiet one, between chunk
sizes, and after recomputation (see `tests/engine/test_batch_invariance.py`).

`batch_invariant_ops()` replaces, for the duration of the context, the two module-level names the
model layers call -- `pagedserve.layers.linear.linear` and `pagedserve.layers.attention.
paged_attention` -- by versions whose every output row is a fixed function of that row's inputs:

- linear: an elementwise product and a sum over the contiguous inner dimension (K);
- attention: per sequence, scores by elementwise product + sum over the head dim, a max, and the
  softmax denominator and weighted values as *sequential* prefix sums (`torch.cumsum`) over the
  keys in position order, read at the query's own position: a query's result depends only on the
  keys 0..pos, never on the chunk it came in, nor on padding.

Only the float32 torch path (no sliding window, one rank in this process) is covered; the compiled
bf16 kernels are untouched. Slow next to the real ops, fine for the tiny test models.
"""

from __future__ import annotations

import contextlib

import torch

from pagedserve.attention.backends.torch_ref import write_kv


def invariant_linear(x, weight, bias=None, out_dtype=None):
    """`F.linear(x, weight, bias)`, each output element a sum over K in a fixed order."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def invariant_paged_attention(query, key, value, k_cache, v_cache, meta, scale,
                              sliding_window=None, use_cpu_kernel=True):
    """`torch_ref.paged_attention` (causal, no window), each query row computed alone."""
    if sliding_window:
        raise ValueError("invariant_paged_attention: sliding windows are not supported")
    write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    n, bs, hkv, _ = k_cache.shape
    flat_k = k_cache.view(n * bs, hkv, head_dim)
    flat_v = v_cache.view(n * bs, hkv, head_dim)
    rep = num_heads // hkv
    out = query.new_empty(num_tokens, num_heads, head_dim)
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i, ctx in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        nq = end - start
        if nq == 0:
            continue
        pos = torch.arange(ctx)
        bs_ = meta.block_size
        slots = meta.block_tables[i, pos // bs_] * bs_ + pos % bs_
        k = flat_k.index_select(0, slots).to(query.dtype).repeat_interleave(rep, dim=1)  # [L, H, D]
        v = flat_v.index_select(0, slots).to(query.dtype).repeat_interleave(rep, dim=1)
        q = query[start:end]  # [nq, H, D]
        scores = (q.unsqueeze(2) * k.transpose(0, 1).unsqueeze(0)).sum(-1) * scale  # [nq, H, L]
        q_pos = torch.arange(ctx - nq, ctx).view(nq, 1, 1)
        scores = scores.masked_fill(pos.view(1, 1, ctx) > q_pos, float("-inf"))
        e = torch.exp(scores - scores.amax(-1, keepdim=True))  # [nq, H, L], 0 where masked
        idx = q_pos.expand(nq, num_heads, 1)  # read every prefix sum at the query's position
        den = torch.cumsum(e, dim=-1).gather(-1, idx)  # [nq, H, 1]
        num = torch.cumsum(e.unsqueeze(-1) * v.transpose(0, 1).unsqueeze(0), dim=2)  # [nq, H, L, D]
        num = num.gather(2, idx.unsqueeze(-1).expand(nq, num_heads, 1, head_dim)).squeeze(2)
        out[start:end] = num / den
    return out


@contextlib.contextmanager
def batch_invariant_ops():
    """Patch the layers' linear and attention with the batch-invariant versions (see module)."""
    saved = _swap((invariant_linear, invariant_paged_attention))
    try:
        yield
    finally:
        _swap(saved)


def install_batch_invariant_ops() -> None:
    """Patch for the rest of the process (scripts; spawned TP workers that import the script)."""
    _swap((invariant_linear, invariant_paged_attention))


def _swap(ops):
    import pagedserve.layers.attention as attention_mod
    import pagedserve.layers.linear as linear_mod

    saved = linear_mod.linear, attention_mod.paged_attention
    linear_mod.linear, attention_mod.paged_attention = ops
    return saved
