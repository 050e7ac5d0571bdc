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

import torch

from pagedserve.kernels.extension import LazyExtension

# probe codes: 1 = scalar code, 2 = AVX2 (grammar_isa() + 1: LazyExtension reads 0 as unusable)
_EXTENSION = LazyExtension(
    "pagedserve_grammar_kernels", ["grammar_mask.cpp"], ["cpu_isa.h"], cflags=[],
    probe=lambda: int(torch.ops.pagedserve_grammar.grammar_isa()) + 1,
    describe=lambda code: "avx2" if code == 2 else "scalar",
    fallback_cost="structured-output masks ~30x slower (35 ms vs 1.2 ms per greedy step of 16 "
                  "rows, docs/benchmarks.md)",
)


def available() -> bool:
    """Whether the kernels can run here (built on first call, thread-safe)."""
    return _EXTENSION.isa() != 0


def isa_name() -> str:
    """"avx2" or "scalar": the code path the kernels take on this CPU (once built)."""
    return "avx2" if _EXTENSION.isa() == 2 else "scalar"


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
