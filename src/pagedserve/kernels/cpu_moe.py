"""An MoE layer's routed experts in one compiled call (csrc/moe.cpp, part of the extension of
`kernels.cpu_gemm`): `moe_experts(...)` computes, for x `[T, H]` and each token's top-k
(expert, weight) pairs, the float32 `[T, H]` sum of `w * down_e(act(gate_e(x)) * up_e(x))` over
the token's experts -- every expert's products over its routed tokens only, on the
format-generic linear kernel (the 8-bit GEMV for few rows, the 8-bit GEMM for many, the
dequantized paths), in one parallel region, with the weights kept as they are stacked
(`[E, N, row_bytes]` blocks with a `QuantSpec`, or bf16 `[E, N, K]`). GPTQ act-order stacks
(`QuantSpec.perm` `[E, K]`, each expert's input order) gather each expert's rows of x / of the
activation in its order first, as `qlinear` does for one expert's weight.

NOTE: bit-identical to `layers.moe.MoEExperts`'s loop over experts on the CPU platform (the same
kernel per product, chosen by the same row counts; the activation by the fp32 extension's formula,
which the layers' `Activation` calls; the same roundings and summation order); so with
batch-invariant weights (`QuantSpec.batch_invariant`, `--batch-invariant`) a token's result does
not depend on its batch. `moe_experts` returns None where that equivalence is not ensured (see its
docstring) and the caller runs the loop.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_fp32 import fp32_kernels_available
from pagedserve.kernels.cpu_gemm import linear_isa
from pagedserve.kernels.cpu_qlinear import gemm_rows

# The activation kernels' names (layers.activation) -> the op's codes (fp32_activation's for the
# first two); "clamped_swiglu": gpt-oss's (models.gpt_oss.ClampedSwiGLU, its sigmoid
# fp32_activation's), with its (alpha, limit)
ACTS = {"silu": 0, "gelu_tanh": 1, "clamped_swiglu": 2}


def _format(w: torch.Tensor, x_dtype: torch.dtype, isa: int) -> tuple[int, int] | None:
    """(format code, gemm_rows) of a stacked expert weight as the kernel takes it for x of
    `x_dtype`, or None: not one the layer's products run on the linear kernel."""
    if w.dim() != 3 or not w.is_cpu or not w.is_contiguous():
        return None
    spec = getattr(w, "quant", None)  # kernels.cpu_qlinear.QuantSpec
    if spec is not None:
        return spec.format.code, gemm_rows(spec, x_dtype, isa)
    if w.dtype is torch.bfloat16 and x_dtype is torch.bfloat16:  # bf16_linear: the kernel, format 0
        return 0, 0
    return None  # fp32 weights: the fp32 extension's products (kernels.cpu_fp32)


def _order(w: torch.Tensor) -> torch.Tensor | None:
    """A stack's input-feature orders (`QuantSpec.perm` `[E, K]`), or None (the checkpoint's)."""
    spec = getattr(w, "quant", None)
    return None if spec is None else spec.perm


def moe_experts(
    x: torch.Tensor,  # [T, H] bf16 or fp32
    weights: torch.Tensor,  # [T, k] routing weights (fp32)
    ids: torch.Tensor,  # [T, k] global expert ids
    expert_start: int,  # the global id of local expert 0 (ids outside the local range: skipped)
    gate: torch.Tensor,  # [E, I, ...] stacked: quantized blocks or bf16
    up: torch.Tensor,  # [E, I, ...]
    down: torch.Tensor,  # [E, H, ...]
    act: str,  # "silu" | "gelu_tanh": the Activation kernel's name; or "clamped_swiglu"
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
    act_params: tuple[float, float] = (0.0, 0.0),  # "clamped_swiglu": (alpha, limit)
) -> torch.Tensor | None:  # [T, H] fp32
    """See the module docstring. None (the caller runs its loop) when the kernels are unavailable,
    gradients are needed, x is not a bf16 / fp32 CPU matrix, a weight is neither quantized nor
    bf16 with bf16 x, the activation is not one of ACTS, the fp32 extension (whose activation
    the layer's `Activation` runs) is unavailable, or an expert's gate and up take x's features
    in different orders (GPTQ act-order: the kernel gathers x once for both)."""
    if act not in ACTS or x.dim() != 2 or not x.is_cpu or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    params = (gate, up, down, *[b for b in biases if b is not None])
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    isa = linear_isa()
    if not isa or not fp32_kernels_available():
        return None
    formats = [_format(w, x.dtype, isa) for w in (gate, up, down)]
    if any(f is None for f in formats):
        return None
    perm_x, perm_up, perm_h = _order(gate), _order(up), _order(down)
    if not (perm_x is perm_up or (perm_x is not None and perm_up is not None and torch.equal(perm_x, perm_up))):
        return None
    if any(p is not None and p.dim() != 2 for p in (perm_x, perm_h)):
        return None
    b32 = [None if b is None else b.detach().float().contiguous() for b in biases]
    return torch.ops.pagedserve_cpu.moe_experts.default(
        x.contiguous(), weights.float().contiguous(), ids.long().contiguous(), int(expert_start),
        gate, up, down, [f[0] for f in formats], [f[1] for f in formats], *b32, perm_x, perm_h, ACTS[act],
        float(act_params[0]), float(act_params[1]), isa)
