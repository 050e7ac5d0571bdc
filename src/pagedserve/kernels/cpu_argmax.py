"""Greedy tokens without fp32 logits on CPU (csrc/argmax.cpp).

A greedy decode step needs one integer per row, but the usual path converts the LM head's bf16
logits to fp32 (16 MB at batch 16 over Gemma 3's 262,144 tokens) and reads them back from memory
for the argmax. `argmax_bf16(x)` scans the bf16 logits instead and returns what
`x.float().argmax(dim=-1)` returns (the conversion is exact and keeps the order): the first
maximum, a NaN counting as the maximum. It returns None when the kernel does not apply (not a bf16
CPU matrix, a gradient needed, the kernels disabled or unavailable); the caller then computes
logits.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa


def argmax_bf16(x: torch.Tensor) -> torch.Tensor | None:  # [M, N] bf16 -> [M] int64
    """`x.argmax(dim=-1)` for a bf16 CPU matrix on the compiled scan, or None (see the module
    docstring)."""
    if x.dim() != 2 or x.dtype is not torch.bfloat16 or not x.is_cpu or x.shape[1] == 0:
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return None
    if not kernel_available():
        return None
    return torch.ops.pagedserve_cpu.argmax_bf16.default(x.contiguous(), linear_isa())
