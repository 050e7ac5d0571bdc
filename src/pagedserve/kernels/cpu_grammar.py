"""A structured-output grammar's token bitmask on fp32 CPU logits (csrc/grammar_mask.cpp).

xgrammar's CPU `apply_token_bitmask_inplace` walks the logits element by element: ~55 ms per
step for 16 rows of Gemma 3's 262,144-token vocabulary, more than the decode step itself. Here:

- `apply_token_bitmask(logits, bitmask, rows)`: the same in-place masking (-inf where the mask
  disallows; tokens past the mask's width too), a word of 32 tokens at a time (AVX2), skipping the
  all-allowed words;
- `masked_argmax(logits, bitmask, rows)`: the greedy token of each row among the tokens its mask
  allows, without writing the logits (the words that allow nothing are not even read): `argmax` of
  the masked row (the first maximum, a NaN counting as the maximum), except that a row whose allowed
  logits are all -inf gives its first allowed token.

The bitmask is xgrammar's: int32 words, ceil(V / 32) per row, bit j % 32 of word j // 32 set
when token j is allowed. Both return None where they do not apply (not a float32 CPU matrix with
contiguous rows, not an int32 mask, the extension disabled by `$PAGEDSERVE_DISABLE_CPU_KERNELS`
or unavailable); the caller then uses xgrammar / torch. The extension is its own (small, quick to
build; it needs no particular ISA: AVX2 where the CPU has it, else scalar code), compiled on first
use, never at import; a failure logs one warning.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

from pagedserve.kernels.cpu_gemm import _disabled

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "grammar_mask.cpp"]
_EXT_PREFIX = "pagedserve_grammar_kernels"

# None = not tried yet, False = unavailable (already warned), True = loaded
_loaded: bool | None = None
_lock = threading.Lock()


def _ext_name() -> str:
    """Prefix + hash of the source and of its folder (two checkouts never share a build folder:
    see `kernels.cpu_fp32._ext_name`)."""
    digest = hashlib.sha1(str(_CSRC.resolve()).encode())
    for path in _SOURCES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return f"{_EXT_PREFIX}_{digest.hexdigest()[:12]}"


def _build() -> None:
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    cpp_extension.load(
        name=_ext_name(),
        sources=[str(p) for p in _SOURCES],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    logger.info("CPU grammar-mask kernels ready in %.1f s (%s)", time.perf_counter() - t0,
                isa_name())


def available() -> bool:
    """Whether the kernels can run here (built on first call, thread-safe)."""
    global _loaded
    if _disabled():
        return False
    if _loaded is None:
        with _lock:
            if _loaded is None:
                try:
                    _build()
                    _loaded = True
                except Exception as e:
                    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    logger.warning("CPU grammar-mask kernels unavailable: %s", reason)
                    logger.debug("CPU grammar-mask kernels failure", exc_info=True)
                    _loaded = False
    return bool(_loaded)


def isa_name() -> str:
    """"avx2" or "scalar": the code path the kernels take on this CPU (once built)."""
    return "avx2" if int(torch.ops.pagedserve_grammar.grammar_isa()) == 1 else "scalar"


def _applies(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    return (logits.dim() == 2 and logits.dtype is torch.float32 and logits.is_cpu
            and logits.shape[1] > 0 and (logits.shape[0] == 0 or logits.stride(1) == 1)
            and bitmask.dim() == 2 and bitmask.dtype is torch.int32 and bitmask.is_cpu
            and available())


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """Mask (to -inf, in place) what `bitmask[g]` disallows in `logits[rows[g]]`, and every token
    past the mask's width; False (nothing done) where the kernel does not apply."""
    if not _applies(logits, bitmask) or bitmask.shape[0] != len(rows):
        return False
    torch.ops.pagedserve_grammar.apply_token_bitmask.default(
        logits, bitmask.contiguous(), torch.tensor(rows, dtype=torch.int64))
    return True


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  scalar: bool = False) -> torch.Tensor | None:
    """[G] int64: the greedy token of `logits[rows[g]]` among those `bitmask[g]` allows (see the
    module docstring); None where the kernel does not apply. `scalar` forces the code for CPUs
    without AVX2 (for tests)."""
    if not _applies(logits, bitmask) or bitmask.shape[0] != len(rows):
        return None
    return torch.ops.pagedserve_grammar.masked_argmax.default(
        logits, bitmask.contiguous(), torch.tensor(rows, dtype=torch.int64), scalar)
