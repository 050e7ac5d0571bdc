"""Batch-invariant float32 kernels on CPU (csrc/fp32_invariant.cpp): a linear layer and paged
attention whose result for a row depends only on that row -- not on the batch it is in, the
prompt chunking, the tiling or the thread count.

Why: torch's fp32 `F.linear` (MKL / oneDNN) chooses kernels and blocking by the row count M, so
the same row gets different bits at M = 1, 2 and M >= 3 (and again at large M); and SDPA over a
prompt chunk sums a query's keys differently than the decode path does. A request's tokens and
logprobs then depended on what it was batched with, on chunked prefill and on recompute after
preemption (which re-prefills tokens first computed in decode steps). With these kernels, float32
on CPU gives the same bits whatever the batch composition, chunking, preemption, swap or prefix
caching.

- `invariant_linear(x, weight, bias)`: `F.linear` with a fixed reduction order over K.
- `invariant_activation(x, name)`: silu / gelu (tanh), every element by one vector formula
  (torch's loops run each parallel chunk's last elements through a scalar path that rounds exp
  and tanh differently; where chunks end depends on the tensor size and the thread count). It
  also takes bf16 x (the fp32 formula on the widened values, one rounding to bf16): 3.4x
  torch's bf16 tanh-GELU (Sleef tanh) on one Zen 5 core at [2000, 2048], and parallel at decode
  sizes (docs/benchmarks.md).
- `invariant_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
  sliding_window, softcap)`: every query token attended alone over its own context, read from the
  cache (the step's K/V written first); soft-capped scores (Gemma 2) with `softcap`.

They return None where they do not apply (not float32 CPU tensors -- the activation also takes
bf16 --, gradients needed, the extension disabled by `$PAGEDSERVE_DISABLE_CPU_KERNELS` or
unavailable) and the caller uses torch.
The extension is its own (it needs only AVX2 + FMA, not the AVX512_BF16 of the bf16 kernels),
compiled on first use like `kernels.cpu_gemm`'s, never at import; a failure logs one warning.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_isa import ISA_AVX2, ISA_AVX512
from pagedserve.kernels.extension import LazyExtension


# isa codes of the C++ ops: 0 = the best this CPU has; else kernels.cpu_isa's levels (csrc/cpu_isa.h's
# one enum and detection, shared by every extension; the levels above AVX-512 add nothing here)
ISAS = {"auto": 0, "avx2": ISA_AVX2, "avx512": ISA_AVX512}

# NOTE: -ffp-contract=off: the compiler must not fuse a multiply and an add the source keeps
# apart (scalar code inside the AVX2/AVX-512 regions could otherwise differ between them).
_EXTENSION = LazyExtension(
    "pagedserve_fp32_kernels",
    ["fp32_invariant.cpp", "recurrent_fp32.cpp"],
    ["fp32_invariant_isa.h", "act_formula.h", "cpu_isa.h", "recurrent_impl.h"],
    cflags=["-ffp-contract=off"],
    probe=lambda: torch.ops.pagedserve_fp32.fp32_isa(),
    describe=lambda isa: "AVX-512" if isa == ISAS["avx512"] else "AVX2",
    fallback_cost="float32 on torch's MKL / SDPA, no longer batch-invariant (a request's tokens "
                  "and logprobs may change with its batch, chunking or preemption)",
)


def _get_isa() -> int | None:
    """The ISA code the kernels use here, building them on first call (thread-safe); None when
    disabled or unavailable."""
    return _EXTENSION.isa() or None


def fp32_kernels_available() -> bool:
    """Whether the fp32 kernels can run here (builds them on first call)."""
    return _get_isa() is not None


def best_isa() -> str | None:
    """"avx512" or "avx2": the instruction set the kernels use here; None when unavailable."""
    isa = _get_isa()
    return None if isa is None else {v: k for k, v in ISAS.items()}[isa]


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` (x: [..., K], weight: [N, K], bias: [N]) with each output row
    computed alone, in a fixed order; None where the kernel does not apply (see the module
    docstring): the caller runs `F.linear`."""
    if (x.dtype is not torch.float32 or weight.dtype is not torch.float32 or not x.is_cpu
            or not weight.is_cpu or weight.dim() != 2 or x.dim() < 1
            or x.shape[-1] != weight.shape[1]
            or (bias is not None and (bias.dtype is not torch.float32 or not bias.is_cpu))
            or _needs_grad(x, weight, bias)):
        return None
    if _get_isa() is None:
        return None
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    y = torch.ops.pagedserve_fp32.fp32_linear.default(
        x2.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), 0)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "sigmoid": 2}


def invariant_activation(x: torch.Tensor, name: str) -> torch.Tensor | None:
    """`F.silu(x)` (name "silu"), `F.gelu(x, approximate="tanh")` ("gelu_tanh") or `torch.sigmoid(x)`
    ("sigmoid": MoE gates, whose [T, 1] shapes torch computes partly scalar), each element
    by the same formula (within ~2 ulp of torch's; bf16 x: rounded once to bf16); None where the
    kernel does not apply (see the module docstring)."""
    if (x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or _needs_grad(x)
            or _get_isa() is None):
        return None
    return torch.ops.pagedserve_fp32.fp32_activation.default(x.contiguous(), ACTIVATIONS[name], 0)


def invariant_gated_activation(gate: torch.Tensor, up: torch.Tensor, name: str) -> torch.Tensor | None:
    """`act(gate) * up` (a gated MLP's middle) in one pass: the same bits as
    `invariant_activation(gate, name) * up` (the activation rounded to bf16 first for bf16 inputs,
    then torch's product), without the activation's tensor; None wherever that pair would not run
    the kernel (see `invariant_activation`), or for shapes this op does not take (not 2-D, rows
    not contiguous, dtypes or shapes that differ)."""
    if (gate.dtype not in (torch.float32, torch.bfloat16) or up.dtype != gate.dtype
            or gate.dim() != 2 or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1
            or not (gate.is_cpu and up.is_cpu) or _needs_grad(gate) or _needs_grad(up)
            or _get_isa() is None):
        return None
    return torch.ops.pagedserve_fp32.fp32_gated_activation.default(gate, up, ACTIVATIONS[name], 0)


def _kernel_activation(x: torch.Tensor, name: str, isa: str = "auto") -> torch.Tensor:
    """The activation kernel with no fallback, on a chosen ISA (tests)."""
    if _get_isa() is None:
        raise RuntimeError("CPU fp32 invariant kernels unavailable (disabled, unsupported CPU, or build failed)")
    return torch.ops.pagedserve_fp32.fp32_activation.default(x, ACTIVATIONS[name], ISAS[isa])


# The attention kernel's caches: float32, or fp8 blocks (kv_cache_dtype; each row widened
# exactly to fp32 as it is read: a token's bits are a float32 cache's holding the same values)
_CACHE_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def invariant_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D] float32 or fp8, the step's K/V already written
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    seq_lens: torch.Tensor,  # [S] int64: context length after this step's tokens
    query_start_loc: torch.Tensor,  # [S + 1] int64: sequence i's query tokens are [qsl[i], qsl[i+1])
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] sink logits (gpt-oss), or None
) -> torch.Tensor | None:  # [T, Hq, D]
    """Causal paged attention of every query token over its own context (the last query_len
    positions of its sequence's seq_len are its query tokens), each token alone, its scores capped
    as `softcap * tanh(s / softcap)` when `softcap` is set, with a sink logit per query head in
    each softmax's denominator when `sinks` is given; None where the kernel does not apply (see
    the module docstring; sinks and a softcap together: no model has both, the torch path)."""
    if (query.dtype is not torch.float32 or k_cache.dtype not in _CACHE_DTYPES
            or v_cache.dtype is not k_cache.dtype or not query.is_cpu or not k_cache.is_cpu
            or _needs_grad(query)):
        return None
    hq, hkv = query.shape[1], k_cache.shape[2]
    if hkv == 0 or hq % hkv or hq // hkv > 64:
        return None
    if _get_isa() is None:
        return None
    if sinks is not None:
        if softcap:
            return None
        return torch.ops.pagedserve_fp32.fp32_paged_attention_sinks.default(
            query.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
            query_start_loc.contiguous(), float(scale), int(sliding_window or 0),
            sinks.detach().float().contiguous(), 0)
    return torch.ops.pagedserve_fp32.fp32_paged_attention.default(
        query.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), float(scale), int(sliding_window or 0), float(softcap or 0.0), 0)


def _kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   isa: str = "auto") -> torch.Tensor:
    """The kernel on a 2-D x, no fallback, on a chosen ISA (tests, benchmarks). RuntimeError if
    unavailable or the CPU lacks `isa`."""
    if _get_isa() is None:
        raise RuntimeError("CPU fp32 invariant kernels unavailable (disabled, unsupported CPU, or build failed)")
    return torch.ops.pagedserve_fp32.fp32_linear.default(x, weight, bias, ISAS[isa])


def _kernel_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                      sliding_window=None, isa: str = "auto", softcap: float | None = None) -> torch.Tensor:
    """The attention kernel with no fallback, on a chosen ISA (tests)."""
    if _get_isa() is None:
        raise RuntimeError("CPU fp32 invariant kernels unavailable (disabled, unsupported CPU, or build failed)")
    return torch.ops.pagedserve_fp32.fp32_paged_attention.default(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale),
        int(sliding_window or 0), float(softcap or 0.0), ISAS[isa])
