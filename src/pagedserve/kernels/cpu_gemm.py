"""The CPU kernel extension (built lazily) and the linear layers' product on it.

`bf16_linear(x, weight, bias, out_dtype)` computes `x @ weight.T (+ bias)` like
`torch.nn.functional.linear`; for bf16 activations on x86-64 CPUs with AVX2 or better it runs the
format-generic kernel (csrc/qlinear.cpp, `kernels.cpu_qlinear`) for every row count, bf16 or
quantized weights, at the ISA level `linear_isa()` picks (AMX, AVX512-BF16, AVX512F, AVX2;
`$PAGEDSERVE_CPU_ISA` caps it). NOTE: one kernel for every row count keeps a row's result
independent of its batch. Everything else (fp32 models, gradients, no kernels) goes to torch.

The extension comes prebuilt with an installed wheel, else is compiled on first use
(`torch.utils.cpp_extension.load`, cached under `$TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions`; see `kernels.extension`), never at import. Any failure --
no compiler, a build error, a CPU without AVX2 -- logs one warning and leaves every call on
torch's path. Set `PAGEDSERVE_DISABLE_CPU_KERNELS=1` to never build or use it (read on every call).
The decode kernels (norms, attention, RoPE, argmax, the fused layer: `kernel_available()`) run at
every level, each built for AVX2 and for AVX-512 on one 16-lane vector type (csrc/vec16.h), so both
builds give the same bits; the sampling kernels need AVX-512 (`sampling_kernel_available()`).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_isa import ISA_AVX512, ISA_NAMES, ISA_NONE, isa_cap
from pagedserve.kernels.extension import DISABLE_ENV, LazyExtension  # noqa: F401 -- DISABLE_ENV re-exported


# Rows the whole-layer decode call (kernels/cpu_decoder_layer.py) takes: its products run on the
# format-generic kernel, which takes any row count.
MAX_M_FUSED = 256

# NOTE: torch's low-precision CPU matmul (oneDNN, and ideep's cache in front of it) keeps a compiled
# primitive per row count -- up to 1,024 in each cache, ~0.3 MiB apiece -- and a server meets
# every row count its prompts and mixed steps produce: RSS crept up for hours under a random load
# (docs/reliability.md, "Soak"). Products above PAD_ABOVE rows that go to torch are padded to a
# multiple of PAD_ROWS rows, so the caches hold a bounded set (max_num_batched_tokens / 64 row
# counts per weight shape) and hit. The padded rows cost at most 63 rows of arithmetic.
PAD_ROWS = 64
PAD_ABOVE = 32
_PADDED_DTYPES = (torch.bfloat16, torch.float16)

# The one extension holds every CPU kernel: the weight-format-generic linear kernel with its
# per-ISA code (kernels/cpu_qlinear.py), the fused RMSNorm (kernels/cpu_norm.py), paged decode
# attention (kernels/cpu_attention.py), q/k norm + RoPE (kernels/cpu_rotary.py), the whole
# decode-step decoder layer built from them (kernels/cpu_decoder_layer.py), the greedy argmax
# (kernels/cpu_argmax.py), random sampling (kernels/cpu_sampling.py) and LoRA's per-token
# shrink / expand (csrc/lora_bgmv.cpp, called from lora/layers.py) and an MoE layer's routed experts
# in one call (csrc/moe.cpp, kernels/cpu_moe.py).
# NOTE: no -march / -mavx512 flags: the AVX-512 and AMX code carries target attributes, so
# nothing compiled for the whole file (static init, feature probing) can use them by accident.
_EXTENSION = LazyExtension(
    "pagedserve_cpu_kernels",
    ["argmax.cpp", "rms_norm.cpp", "paged_attention.cpp", "rotary.cpp", "decoder_layer.cpp",
     "sampling.cpp", "qlinear.cpp", "threads.cpp", "prefill_attention.cpp", "lora_bgmv.cpp",
     "moe.cpp", "linear_heads.cpp"],
    ["cpu_isa.h", "qformats.h", "qlinear_blocks.h", "qlinear_impl.h", "qlinear_q8.h", "qlinear_q8_vnni.h", "qlinear_q8_gemm.h", "qlinear_bcast.h", "qlinear_vnni.h",
     "vec16.h",
     "vec16_build.h", "argmax_impl.h", "argmax_best.h", "argmax_rows.h",
     "rms_norm_impl.h", "paged_attention_impl.h", "rotary_impl.h", "lora_bgmv_impl.h",
     "qlinear_api.h", "moe_impl.h", "act_formula.h", "omp_region.h", "transpose16.h", "amx_tiles.h"],
    # NOTE: -ffp-contract=off: the compiler fuses no multiply and add the source does not, so the
    # AVX2 and AVX-512 builds of the row kernels (csrc/vec16.h) perform the same IEEE operations.
    cflags=["-ffp-contract=off"],
    probe=lambda: torch.ops.pagedserve_cpu.cpu_isa(),
    describe=lambda isa: f"best ISA: {ISA_NAMES[isa]}",
    fallback_cost="~8x slower decoding (the embedded model at batch 1: 739 vs 89 ms per step on 2 "
                  "Zen 4 cores, docs/benchmarks.md), GGUF weights dequantized",
)


def _cpu_isa() -> int:
    """The CPU's ISA level (kernels.cpu_isa) with the extension built on first call; ISA_NONE
    when disabled or unavailable (warned once)."""
    return _EXTENSION.isa()


def linear_isa() -> int:
    """The ISA level `kernels.cpu_qlinear.qlinear` runs at: the CPU's, capped by
    `$PAGEDSERVE_CPU_ISA`; ISA_NONE when the kernels are disabled or unavailable."""
    isa = _cpu_isa()
    return min(isa, isa_cap()) if isa else ISA_NONE


def kernel_available() -> bool:
    """Whether the bf16 decode kernels (norms, RoPE, attention, argmax, the fused decoder layer)
    can run here, at `linear_isa()` (builds them on first call).

    False when disabled by `$PAGEDSERVE_DISABLE_CPU_KERNELS`, on CPUs without AVX2 + FMA, or if
    the build failed (logged once).
    """
    return linear_isa() != ISA_NONE


def sampling_kernel_available() -> bool:
    """Whether the sampling / logprob kernels (csrc/sampling.cpp, AVX-512 only) can run here:
    `kernel_available()` at the avx512 level or above."""
    return linear_isa() >= ISA_AVX512


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (last dim K)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if out_dtype is not None and out_dtype not in (torch.bfloat16, torch.float32, x.dtype):
        raise ValueError(f"out_dtype must be None, torch.bfloat16 or torch.float32, got {out_dtype}")


def _use_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int) -> bool:
    return (
        0 < m
        and x.shape[-1] > 0
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or bias.is_cpu)
        # the kernel has no autograd; inference runs under no_grad / inference_mode
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
    )


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` (as `F.linear`), on the compiled kernel when that is faster.

    x: [..., K]; weight: [N, K]; bias: [N] (any float dtype) or None; result: [..., N] in
    `out_dtype` (None: x.dtype; else torch.bfloat16 or torch.float32).

    The kernel runs when x and weight are bf16 CPU tensors, weight is contiguous, no gradient is
    needed and `linear_isa()` is not ISA_NONE, for any M (the product of x's leading dims); a
    quantized weight (`kernels.cpu_qlinear`) always does. It accumulates in fp32 and rounds once
    to the output dtype, so `out_dtype=torch.float32` gives unrounded logits. Otherwise this is
    `F.linear(x, weight, bias)` cast to `out_dtype` (there a bf16 result is rounded to bf16 before
    any cast to fp32). ValueError on mismatched shapes or an unsupported `out_dtype`.
    """
    spec = getattr(weight, "quant", None)  # a quantized weight (kernels.cpu_qlinear.QuantSpec)
    if spec is not None:  # (the spec runs its own product: this module imports no cpu_qlinear)
        return spec.linear(x, weight, bias, out_dtype)
    _check_args(x, weight, bias, out_dtype)
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if _use_kernel(x, weight, bias, m):
        isa = linear_isa()
        if isa:
            # NOTE: every row count goes to the one kernel, whose per-row results do not depend
            # on the batch (a request's tokens do not change with the requests beside it).
            out_fp32 = out_dtype == torch.float32
            x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(m, k).contiguous()
            y = torch.ops.pagedserve_cpu.qlinear.default(x2, weight, 0, k, bias, out_fp32, isa, 0)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if m > PAD_ABOVE and m % PAD_ROWS and x.dtype in _PADDED_DTYPES and x.is_cpu:
        y = _padded_linear(x, weight, bias, m)
    else:
        y = F.linear(x, weight, bias)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def linear_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:  # [T, Hh, N]
    """`y[:, h] = x[:, h] @ weight[h].T` for x `[T, Hh, K]` and bf16 weights `[Hh, N, K]` (a
    different weight per head: MLA's absorbed projections) in one compiled call, bit-identical
    to `bf16_linear(x[:, h], weight[h])` head by head; None where that loop would not take the
    kernel (not bf16 CPU tensors, a gradient needed, kernels unavailable) -- run the loop."""
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: [T, Hh, K] and [Hh, N, K]")
    if getattr(weight, "quant", None) is not None or not _use_kernel(x, weight, None, x.shape[0]):
        return None
    isa = linear_isa()
    if not isa:
        return None
    return torch.ops.pagedserve_cpu.qlinear_heads.default(x, weight, 0, x.shape[2], isa, 0)


def _padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int) -> torch.Tensor:
    """`F.linear` with the rows of x zero-padded to a multiple of PAD_ROWS (the extra output rows
    dropped): see PAD_ROWS."""
    k = x.shape[-1]
    mp = -(-m // PAD_ROWS) * PAD_ROWS
    xp = x.new_empty(mp, k)  # [Mp, K]
    xp[:m] = x.reshape(m, k)
    xp[m:] = 0
    return F.linear(xp, weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])  # [..., N]
