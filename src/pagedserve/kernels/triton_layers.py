"""Triton kernels of the CUDA platform's layer ops (`platforms.cuda.CudaLayerOps`).

- `rms_norm(x, weight_f32, eps, numerics)`: one program per row, bit for bit the eager formula of
  `layers.norms` except the order of the sum of squares (an ulp of the statistic, as the CPU
  kernel): "llama" `w * bf16(x * r)` (the product rounded to the input dtype), "gemma"
  `(x * r * (1 + w))` rounded once.
- `silu_and_mul(gate, up)`: `bf16(bf16(silu(gate)) * up)`, a gated MLP's middle in one pass
  over its two halves (which may be column views of the fused gate|up product), where torch
  runs two kernels, the first a strided one. The exponential is Triton's: an fp32 ulp from
  torch's at most, so a bf16 result may round the other way on a rare element.
- `qk_norm_rope_(q, k, cos, sin, q_weight, k_weight, eps, numerics)`: per-head q/k RMSNorm
  (optional) and rotate-half RoPE over the whole head, in place, one program per (token, head):
  `bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))`, as `layers.rotary.apply_rotary` rounds.

At a decode step these replace ~7 small torch kernels per norm and ~10 per RoPE, each a launch
of ~2 us on a GPU whose whole step is a few ms (docs/benchmarks.md, "The CUDA path on an H200").
Both take bf16 activations only: every product of two bf16 values is exact in fp32, so rounding
it once gives torch's result whatever the compiler contracts; float32 and float16 stay on torch's
ops. Under `TRITON_INTERPRET=1` (set before triton is imported) they run on CPU tensors (the
tests). NOTE: the interpreter's float32 -> bf16 cast truncates where the GPU rounds to nearest
even, so the kernels round in integer arithmetic (`_round_bf16`) and cast only exact values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW = 1 << 16  # widest row one program normalises (its whole row in registers)


@triton.jit
def _round_bf16(x):
    """float32 `x` rounded to the nearest bf16 (ties to even), still as float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps,
                     GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if GEMMA:
        y = _round_bf16(x * r * w)
    else:  # Llama: the normalised row is rounded to the activation dtype before the weight
        y = _round_bf16(_round_bf16(x * r) * w)
    tl.store(out_ptr + row * stride_out + offs, y.to(tl.bfloat16), mask=mask)


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float,
             numerics: str) -> torch.Tensor | None:
    """RMSNorm of the last dimension of bf16 `x` (`[..., H]`) with the float32 `[H]` weight
    (Gemma: `1 + weight`), or None where the kernel does not apply (another dtype, a row wider
    than MAX_ROW, an unknown `numerics`)."""
    n = x.shape[-1]
    if (x.dtype != torch.bfloat16 or numerics not in ("llama", "gemma") or n == 0 or n > MAX_ROW
            or weight_f32.shape != (n,) or weight_f32.dtype != torch.float32):
        return None
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight_f32, out, rows.stride(0), out.stride(0), n, eps,
            GEMMA=numerics == "gemma", BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, n,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    a = _round_bf16(g / (1.0 + tl.exp(-g)))  # torch's bf16 silu: fp32 math, one rounding
    tl.store(out_ptr + row * stride_o + offs, _round_bf16(a * u).to(tl.bfloat16), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` for bf16 `[T, I]` halves with unit stride along I (a fused product's
    column views are fine), or None where the kernel does not apply."""
    if (gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16 or gate.dim() != 2
            or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1):
        return None
    t, n = gate.shape
    out = torch.empty((t, n), dtype=gate.dtype, device=gate.device)
    if t and n:
        block = min(2048, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n, BLOCK=block,
            num_warps=4)
    return out


@triton.jit
def _norm_rope_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, stride_xt, stride_xh, stride_ct, eps,
                      HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                      NORM: tl.constexpr):
    # NORM: 0 none, 1 Gemma, 2 Llama (kernels.cpu_rotary's codes)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)  # [D/2] first half
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)  # [D/2] second half
    if NORM != 0:
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0)
        if NORM == 1:
            x1 = _round_bf16(x1 * r * w1)
            x2 = _round_bf16(x2 * r * w2)
        else:
            x1 = _round_bf16(_round_bf16(x1 * r) * w1)
            x2 = _round_bf16(_round_bf16(x2 * r) * w2)
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1); each product rounded as torch's bf16 mul, then the sum
    y1 = _round_bf16(_round_bf16(x1 * c1) + _round_bf16(-x2 * s1))
    y2 = _round_bf16(_round_bf16(x2 * c2) + _round_bf16(x1 * s2))
    tl.store(base + offs, y1.to(tl.bfloat16), mask=mask)
    tl.store(base + HALF + offs, y2.to(tl.bfloat16), mask=mask)


_NORM_CODES = {None: 0, "gemma": 1, "llama": 2}


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  numerics: str | None) -> bool:
    """Per-head norm (`numerics` None: none) and RoPE of `q [T, Hq, D]` and `k [T, Hkv, D]` in
    place with `cos`/`sin [T, D]`; False (nothing touched) where the kernel does not apply: not
    bf16, heads not unit-stride in their last dimension, an odd head size, tables of another
    shape or dtype."""
    if numerics not in _NORM_CODES or q.dim() != 3 or k.dim() != 3:
        return False
    t, _, d = q.shape
    if (q.dtype != torch.bfloat16 or k.dtype != q.dtype or cos.dtype != q.dtype
            or sin.dtype != q.dtype or d % 2 or d > MAX_ROW or k.shape[0] != t or k.shape[2] != d
            or cos.shape != (t, d) or sin.shape != (t, d) or sin.stride() != cos.stride()
            or q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1):
        return False
    norm = _NORM_CODES[numerics]
    if norm and any(w is None or w.shape != (d,) or w.dtype != torch.float32
                    for w in (q_weight, k_weight)):
        return False
    if t == 0:
        return True
    half = d // 2
    block = triton.next_power_of_2(half)
    for x, w in ((q, q_weight), (k, k_weight)):
        _norm_rope_kernel[(t, x.shape[1])](
            x, cos, sin, w if norm else cos, x.stride(0), x.stride(1), cos.stride(0), eps,
            HEAD_DIM=d, HALF=half, BLOCK=block, NORM=norm, num_warps=1 if block <= 128 else 4)
    return True
