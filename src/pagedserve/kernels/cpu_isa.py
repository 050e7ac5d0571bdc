"""Which x86 ISA level the compiled CPU kernels may use: the CPU's best, capped by
`$PAGEDSERVE_CPU_ISA` (amx | avx512bf16 | avx512 | avx2), so that every code path can be tested and
benchmarked on one machine. Levels, lowest first: avx2 (AVX2 + FMA), avx512 (AVX512F/BW/VL/DQ),
avx512bf16 (+ AVX512-BF16), amx (+ AMX-BF16 tiles)."""

from __future__ import annotations

import os

ISA_ENV = "PAGEDSERVE_CPU_ISA"

ISA_NONE, ISA_AVX2, ISA_AVX512, ISA_AVX512BF16, ISA_AMX = 0, 1, 2, 3, 4
ISA_LEVELS = {"avx2": ISA_AVX2, "avx512": ISA_AVX512, "avx512bf16": ISA_AVX512BF16, "amx": ISA_AMX}
ISA_NAMES = {level: name for name, level in ISA_LEVELS.items()} | {ISA_NONE: "none"}


def isa_cap() -> int:
    """The level `$PAGEDSERVE_CPU_ISA` allows (ISA_AMX when unset; read on every call).
    ValueError naming the variable for an unknown value."""
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if not raw:
        return ISA_AMX
    level = ISA_LEVELS.get(raw)
    if level is None:
        raise ValueError(f"{ISA_ENV}={raw!r}: must be one of {', '.join(ISA_LEVELS)}")
    return level
