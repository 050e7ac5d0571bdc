"""Fused RMSNorm for bf16 activations on CPU (csrc/rms_norm.cpp, part of the extension of kernels.cpu_gemm).

`rms_norm(x, weight_f32, eps, llama)` returns the normalised `x` like the eager formulas of
`layers.norms` (HF's numerics), or None when the kernel does not apply -- not a bf16 CPU tensor,
a gradient is needed, the kernel is disabled (`PAGEDSERVE_DISABLE_CPU_KERNELS=1`) or unavailable
-- and the caller then runs the eager formula. On a decode batch the eager formula is ~9 small
torch ops per norm, and a Gemma 3 step runs 109 norms: the fused kernel removes most of that
per-op cost.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa


def rms_norm(
    x: torch.Tensor,  # [..., H] bfloat16
    weight_f32: torch.Tensor,  # [H] float32: 1 + weight (Gemma) or the bf16 weight as fp32 (Llama)
    eps: float,
    llama: bool,
) -> torch.Tensor | None:  # [..., H] bfloat16, or None: use the eager formula
    """See the module docstring. `llama`: round `x * r` to bf16 before the weight multiplies it
    (`LlamaRMSNorm`); else multiply in fp32 and round once (`Gemma3RMSNorm`)."""
    if x.dtype is not torch.bfloat16 or not x.is_cpu or (x.requires_grad and torch.is_grad_enabled()):
        return None
    if not kernel_available() or x.numel() == 0:
        return None
    op = torch.ops.pagedserve_cpu.rms_norm.default
    if x.dim() == 2 and x.is_contiguous():  # the usual case: no reshapes
        return op(x, weight_f32, eps, llama, linear_isa())
    h = x.shape[-1]
    return op(x.reshape(-1, h).contiguous(), weight_f32, eps, llama, linear_isa()).view(x.shape)
