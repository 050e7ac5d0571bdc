"""Paged decode attention on CPU (csrc/paged_attention.cpp, part of the extension of kernels.cpu_gemm).

`decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)` attends
one query token per sequence over its blocks, reading the cache in place (no gathered copy, no
mask), or returns None when the kernel does not apply -- not bf16 CPU tensors, a head size that
is not a multiple of 16 (or above 512), more than 16 query heads per KV head, the kernel disabled
(`PAGEDSERVE_DISABLE_CPU_KERNELS=1`) or unavailable -- and the caller runs the torch path.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa


def decode_attention(
    query: torch.Tensor,  # [S, Hq, D] one query token per sequence
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    seq_lens: torch.Tensor,  # [S] int64, the new token included (its K/V already written)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:  # [S, Hq, D] bf16, or None: use the torch path
    """See the module docstring."""
    if (query.dtype is not torch.bfloat16 or k_cache.dtype is not torch.bfloat16
            or not query.is_cpu or not k_cache.is_cpu):
        return None
    s, hq, d = query.shape
    hkv = k_cache.shape[2]
    if d % 16 or d > 512 or hq % hkv or hq // hkv > 16 or s == 0:
        return None
    if not kernel_available():
        return None
    return torch.ops.pagedserve_cpu.decode_attention.default(
        query.contiguous(), k_cache, v_cache, block_tables, seq_lens, float(scale),
        int(sliding_window or 0), linear_isa())
