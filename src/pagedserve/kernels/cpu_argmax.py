"""Greedy tokens without fp32 logits on CPU (csrc/bf16_gemv.cpp, built with the GEMV kernel).

A greedy decode step needs one integer per row, but the usual path writes the LM head's bf16
logits, converts them to fp32 (16 MB at batch 16 over Gemma 3's 262,144 tokens) and reads them back
from memory for the argmax. Here:

- `linear_argmax(x, weight)`: the LM head product on the GEMV kernel (small batches), each chunk of
  its bf16 output scanned for the row maxima right after it is written (still in cache);
- `argmax_bf16(x)`: the scan alone, over bf16 logits torch computed (larger batches).

Both return what `x @ weight.T` rounded to bf16, converted to fp32, then `argmax(dim=-1)` returns
(the conversion is exact and keeps the order): the first maximum, a NaN counting as the maximum.
They return None when the kernel does not apply (not bf16 CPU tensors, a gradient needed, too
many rows for the GEMV kernel, the kernel disabled or unavailable); the caller then computes logits.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_gemm import _ALGOS, _get_kernel, _use_kernel


def linear_argmax(
    x: torch.Tensor,  # [M, K] bf16
    weight: torch.Tensor,  # [N, K] bf16
    algo: str = "auto",
) -> torch.Tensor | None:  # [M] int64
    """`argmax(x @ weight.T)` per row on the GEMV kernel, or None (see the module docstring).
    `algo` (auto|avx512|amx) picks the kernel's path, for tests."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.shape[0] == 0:
        return None
    m = x.shape[0]
    if not _use_kernel(x, weight, None, m):
        return None
    kernel = _get_kernel()
    if kernel is None or m > kernel.max_m:
        return None
    return torch.ops.pagedserve_cpu.bf16_linear_argmax.default(x.contiguous(), weight, _ALGOS[algo])


def argmax_bf16(x: torch.Tensor) -> torch.Tensor | None:  # [M, N] bf16 -> [M] int64
    """`x.argmax(dim=-1)` for a bf16 CPU matrix on the compiled scan, or None (see the module
    docstring)."""
    if x.dim() != 2 or x.dtype is not torch.bfloat16 or not x.is_cpu or x.shape[1] == 0:
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return None
    if _get_kernel() is None:
        return None
    return torch.ops.pagedserve_cpu.argmax_bf16.default(x.contiguous())
