"""Attention kernels on CPU (part of the extension of kernels.cpu_gemm): paged decode attention
(csrc/paged_attention.cpp) and a prompt chunk's attention over its context (csrc/prefill_attention.cpp: AVX512-BF16 and
AVX2 builds).

`decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)` attends
one query token per sequence over its blocks, reading the cache in place (no gathered copy, no
mask; bf16 or fp8 caches, a bf16 query; any number of query heads per KV head, in runs of 16),
or returns None when the kernel does not apply -- not bf16 CPU tensors (fp8 caches aside), a
head size that is not a multiple of 16 (or above 1024: MLA's latent + rope key, 576, fits), the
kernel disabled
(`PAGEDSERVE_DISABLE_CPU_KERNELS=1`) or unavailable -- and the caller runs the torch path.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa
from pagedserve.kernels.cpu_isa import ISA_LEVELS


# The decode kernel's caches: bf16, or fp8 blocks (kv_cache_dtype: 16 values widened exactly to
# fp32 as they are loaded, csrc/vec16.h v_load_e4m3 / v_load_e5m2)
_CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def decode_attention(
    query: torch.Tensor,  # [S, Hq, D] one query token per sequence
    k_cache: torch.Tensor,  # [N, B, Hkv, D] bf16 or fp8
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    seq_lens: torch.Tensor,  # [S] int64, the new token included (its K/V already written)
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] sink logits (gpt-oss), or None
) -> torch.Tensor | None:  # [S, Hq, D] bf16, or None: use the torch path
    """See the module docstring. `sinks`: one logit per query head in each softmax's
    denominator, with no value (gpt-oss's sinks)."""
    if (query.dtype is not torch.bfloat16 or k_cache.dtype not in _CACHE_DTYPES
            or v_cache.dtype is not k_cache.dtype or not query.is_cpu or not k_cache.is_cpu):
        return None
    s, hq, d = query.shape
    hkv = k_cache.shape[2]
    if d % 16 or d > 1024 or hq % hkv or s == 0:
        return None
    if not kernel_available():
        return None
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    return torch.ops.pagedserve_cpu.decode_attention.default(
        query.contiguous(), k_cache, v_cache, block_tables, seq_lens, float(scale),
        int(sliding_window or 0), linear_isa(), sinks)


def prefill_attention(
    query: torch.Tensor,  # [n, Hq, D] the chunk's queries (rows may be strided, heads contiguous)
    key: torch.Tensor,  # [ctx, Hkv, D] the whole context's keys, the chunk's last
    value: torch.Tensor,  # [ctx, Hkv, D]
    out: torch.Tensor,  # [n, Hq, D] written
    scale: float,
    sliding_window: int | None = None,
    key_start: int = 0,
) -> bool:
    """Causal attention of a prompt chunk (the last n positions of a context of ctx) over its
    context, written into `out`: True, or False when the kernel does not apply -- not bf16 CPU
    tensors, a CPU without AVX2 + FMA (or capped below it), a head size that is not a multiple
    of 32 (or above 1024: MLA's 576 fits), the kernel disabled or unavailable -- and the caller
    runs SDPA.

    Scores and softmax in fp32, one rounding of the output. The weights are rounded to bf16
    for the product with V (as a bf16 flash kernel does: on AMX tiles with AMX, vdpbf16ps on
    AVX512-BF16, widened back to fp32 on AVX2, csrc/prefill_attention.cpp `amx::`, `avx2::`).
    Either way a row's result does not depend on the rows computed with it (chunking keeps
    every bit); the ISAs' bits differ.

    `key_start`: the sequence position of key 0 when the caller trimmed the context's head (a
    sliding window: keys before it are never read). It must be even (the AVX512-BF16 kernel
    pairs keys from key 0); the AMX kernel tiles keys by 32 from position 0 of the sequence,
    so that any trim gives the same bits."""
    if key_start < 0 or key_start % 2:
        raise ValueError(f"prefill_attention: key_start must be even and >= 0, got {key_start}")
    if not (query.dtype is key.dtype is value.dtype is out.dtype is torch.bfloat16) or not query.is_cpu:
        return False
    d = query.shape[2]
    if d % 32 or d > 1024 or query.shape[1] % key.shape[1] or query.shape[0] == 0:
        return False
    isa = linear_isa()
    if not kernel_available() or isa < ISA_LEVELS["avx2"]:
        return False
    heads_ok = all(t.stride(2) == 1 and t.stride(1) == d for t in (query, key, value, out))
    if not heads_ok or key.stride(0) != value.stride(0):
        key, value = key.contiguous(), value.contiguous()
        if not (query.stride(2) == 1 and query.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d):
            return False
    torch.ops.pagedserve_cpu.prefill_attention.default(query, key, value, out, float(scale),
                                                       int(sliding_window or 0), isa, int(key_start))
    return True
