"""The CPU kernel extension (built lazily) and the linear layers' product on it.

`bf16_linear(x, weight, bias, out_dtype)` computes `x @ weight.T (+ bias)` like
`torch.nn.functional.linear`; for bf16 activations on x86-64 CPUs with AVX2 or better it runs the
format-generic kernel (csrc/qlinear.cpp, `kernels.cpu_qlinear`) for every row count, bf16 or
quantized weights, at the ISA level `linear_isa()` picks (AMX, AVX512-BF16, AVX512F, AVX2;
`$PAGEDSERVE_CPU_ISA` caps it). NOTE: one kernel for every row count keeps a row's result
independent of its batch. Everything else (fp32 models, gradients, no kernels) goes to torch.
The older GEMV (csrc/bf16_gemv.cpp: `_kernel_linear`, the fused argmax) stays for its callers.

The extension is compiled on first use (`torch.utils.cpp_extension.load`, cached under
`$TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`), never at import. Any failure --
no compiler, a build error, a CPU without AVX2 -- logs one warning and leaves every call on
torch's path. Set `PAGEDSERVE_DISABLE_CPU_KERNELS=1` to never build or use it (read on every call).
The AVX512-BF16 kernels (norms, attention, RoPE, sampling, the fused layer: `kernel_available()`)
need that level; on AVX2-only CPUs (or capped there) those steps run in torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_isa import ISA_AMX, ISA_AVX512BF16, ISA_NAMES, ISA_NONE, isa_cap

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"

# Row limits of the older bf16 GEMV (csrc/bf16_gemv.cpp: `_kernel_linear`, the fused LM-head
# argmax): its AMX path takes M <= 32; its AVX512_BF16 path is compute-bound from M ~ 4 on.
MAX_M_AMX = 32
MAX_M_AVX512 = 4
MAX_M = max(MAX_M_AMX, MAX_M_AVX512)
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

# The one extension holds every CPU kernel: the GEMV, the fused RMSNorm (kernels/cpu_norm.py),
# paged decode attention (kernels/cpu_attention.py), q/k norm + RoPE (kernels/cpu_rotary.py), the
# whole decode-step decoder layer built from them (kernels/cpu_decoder_layer.py), the greedy argmax
# (kernels/cpu_argmax.py) and random sampling (kernels/cpu_sampling.py).
# (and the weight-format-generic linear kernel with its per-ISA code, kernels/cpu_qlinear.py).
_SOURCES = [Path(__file__).with_name("csrc") / name
            for name in ("bf16_gemv.cpp", "rms_norm.cpp", "paged_attention.cpp", "rotary.cpp",
                         "decoder_layer.cpp", "sampling.cpp", "qlinear.cpp")]
_HEADERS = [Path(__file__).with_name("csrc") / name for name in ("qlinear_impl.h", "qlinear_q8.h")]
_EXT_PREFIX = "pagedserve_cpu_kernels"


def _ext_name() -> str:
    """The extension's name, which is also its build folder: the prefix and a hash of the
    sources. NOTE: two source trees on one machine (two checkouts, two installed versions) must
    not share a build folder: cpp_extension would rebuild it back and forth, and a process
    starting in between could load the other tree's library (ops missing or different)."""
    digest = hashlib.sha1()
    for path in _SOURCES + _HEADERS:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return f"{_EXT_PREFIX}_{digest.hexdigest()[:12]}"


class _Kernel(NamedTuple):
    op: Callable  # torch.ops.pagedserve_cpu.bf16_linear.default
    max_m: int  # rows the fused decode layer takes (MAX_M_FUSED)


# The lazily built extension: None = not tried yet, False = unavailable (already warned), else the
# CPU's ISA level (kernels.cpu_isa).
_kernel: int | bool | None = None
_kernel_lock = threading.Lock()

# algo codes understood by the C++ op
_ALGOS = {"auto": 0, "avx512": 1, "amx": 2}


def _disabled() -> bool:
    raw = os.environ.get(DISABLE_ENV)
    return raw is not None and raw.strip().lower() not in ("", "0", "false", "no", "off")


def _build() -> int:
    """Compile and load the extension; returns the CPU's ISA level (kernels.cpu_isa) or raises
    with the reason."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"not an x86-64 CPU ({platform.machine()})")
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    # NOTE: no -march / -mavx512 flags: the AVX-512 and AMX code carries target attributes, so
    # nothing compiled for the whole file (static init, feature probing) can use them by accident.
    # -fopenmp is required: at::parallel_for is a header template over `#pragma omp parallel`;
    # libgomp then resolves to the copy torch has already loaded (same soname).
    # NOTE: cpp_extension serialises concurrent builds (other processes too) with a lock file in
    # the build folder; a process killed mid-build leaves it behind and later builds wait on it:
    # delete `$TORCH_EXTENSIONS_DIR/<py>_cpu/pagedserve_cpu_kernels_<hash>/lock` if first use hangs.
    cpp_extension.load(
        name=_ext_name(),
        sources=[str(p) for p in _SOURCES],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(_SOURCES[0].parent)],
        is_python_module=False,
        verbose=False,
    )
    isa = int(torch.ops.pagedserve_cpu.cpu_isa())
    if isa == ISA_NONE:
        raise RuntimeError("the CPU (or OS) lacks AVX2 + FMA")
    logger.info("CPU kernels ready in %.1f s (best ISA: %s)", time.perf_counter() - t0, ISA_NAMES[isa])
    return isa


def _cpu_isa() -> int:
    """The CPU's ISA level with the extension built (on first call, thread-safe); ISA_NONE when
    disabled or unavailable (warned once)."""
    global _kernel
    if _disabled():
        return ISA_NONE
    k = _kernel
    if k is None:
        with _kernel_lock:
            if _kernel is None:
                try:
                    _kernel = _build()
                except Exception as e:  # noqa: BLE001 -- any failure means: use torch
                    # first line only: a build error carries the whole compiler log (at debug)
                    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    logger.warning("CPU kernels unavailable, using torch: %s", reason)
                    logger.debug("CPU kernel failure", exc_info=True)
                    _kernel = False
            k = _kernel
    return int(k) if k else ISA_NONE


def linear_isa() -> int:
    """The ISA level `kernels.cpu_qlinear.qlinear` runs at: the CPU's, capped by
    `$PAGEDSERVE_CPU_ISA`; ISA_NONE when the kernels are disabled or unavailable."""
    isa = _cpu_isa()
    return min(isa, isa_cap()) if isa else ISA_NONE


def _get_kernel() -> _Kernel | None:
    """The AVX512-BF16 kernels (GEMV, norms, attention, ...), building the extension on first
    call; None when disabled, unavailable, or the ISA (or its cap) is below AVX512-BF16."""
    isa = linear_isa()
    if isa < ISA_AVX512BF16:
        return None
    return _Kernel(torch.ops.pagedserve_cpu.bf16_linear.default, MAX_M_FUSED)


def kernel_available() -> bool:
    """Whether the AVX512-BF16 kernels can run here (builds them on first call).

    False when disabled by `$PAGEDSERVE_DISABLE_CPU_KERNELS`, capped below avx512bf16 by
    `$PAGEDSERVE_CPU_ISA`, on CPUs without AVX512_BF16, or if the build failed (logged once).
    """
    return _get_kernel() is not None


def amx_available() -> bool:
    """Whether the kernels can use AMX tiles here (implies `kernel_available()`)."""
    return linear_isa() >= ISA_AMX and bool(torch.ops.pagedserve_cpu.features()[1])


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
    if spec is not None:
        from pagedserve.kernels.cpu_qlinear import qlinear

        return qlinear(x, weight, bias, out_dtype)
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
            y = torch.ops.pagedserve_cpu.qlinear.default(x2, weight, 0, k, bias, out_fp32, isa)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if m > PAD_ABOVE and m % PAD_ROWS and x.dtype in _PADDED_DTYPES and x.is_cpu:
        y = _padded_linear(x, weight, bias, m)
    else:
        y = F.linear(x, weight, bias)
    return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)


def _padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int) -> torch.Tensor:
    """`F.linear` with the rows of x zero-padded to a multiple of PAD_ROWS (the extra output rows
    dropped): see PAD_ROWS."""
    k = x.shape[-1]
    mp = -(-m // PAD_ROWS) * PAD_ROWS
    xp = x.new_empty(mp, k)  # [Mp, K]
    xp[:m] = x.reshape(m, k)
    xp[m:] = 0
    return F.linear(xp, weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])  # [..., N]


def _kernel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    algo: str = "auto",
) -> torch.Tensor:
    """The kernel itself for a 2-D x, with no fallback (tests, benchmarks). algo: auto|avx512|amx.

    RuntimeError if the kernel is unavailable, or `algo="amx"` is not possible for this CPU/shape.
    """
    _check_args(x, weight, bias, out_dtype)
    if algo not in _ALGOS:
        raise ValueError(f"algo must be one of {sorted(_ALGOS)}, got {algo!r}")
    kernel = _get_kernel()
    if kernel is None:
        raise RuntimeError("CPU bf16 GEMV kernel unavailable (disabled, unsupported CPU, or build failed)")
    return kernel.op(x, weight, bias, out_dtype == torch.float32, _ALGOS[algo])
