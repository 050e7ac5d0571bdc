"""Fused per-head q/k RMSNorm + RoPE on CPU (csrc/rotary.cpp, part of the extension of kernels.cpu_gemm).

`qk_norm_rope_(q, k, cos, sin, q_weight, k_weight, eps, norm)` normalises (optionally) and rotates
the q and k heads in place, bit-identical to the eager ops of `layers.norms` and
`layers.rotary.apply_rotary` except for an ulp of the norm's statistics; returns False (touching
nothing) when the kernel does not apply -- not bf16 CPU tensors, not contiguous, a head size that
is not a multiple of 32 (or above 512), a gradient needed, the kernel disabled
(`PAGEDSERVE_DISABLE_CPU_KERNELS=1`) or unavailable -- and the caller runs the eager ops. At
decode those are ~16 small torch ops a layer; the kernel is one.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa

NORM_NONE, NORM_GEMMA, NORM_LLAMA = 0, 1, 2


def qk_norm_rope_(
    q: torch.Tensor,  # [T, Hq, D] bf16, modified in place
    k: torch.Tensor,  # [T, Hkv, D] bf16, modified in place
    cos: torch.Tensor,  # [T, D] bf16
    sin: torch.Tensor,  # [T, D] bf16
    q_weight: torch.Tensor | None,  # [D] fp32 (see kernels.cpu_norm) when norm != NORM_NONE
    k_weight: torch.Tensor | None,
    eps: float,
    norm: int,
) -> bool:
    """See the module docstring; True when q and k were updated in place."""
    tensors = (q, k, cos, sin)
    if any(t.dtype is not torch.bfloat16 or not t.is_cpu or not t.is_contiguous() for t in tensors):
        return False
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or q.shape[0] == 0:
        return False
    d = q.shape[2]
    if d % 32 or d > 512 or k.shape[2] != d or cos.shape != (q.shape[0], d) or sin.shape != cos.shape:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    if not kernel_available():
        return False
    torch.ops.pagedserve_cpu.qk_norm_rope_.default(q, k, cos, sin, q_weight, k_weight, float(eps), norm,
                                                  linear_isa())
    return True
