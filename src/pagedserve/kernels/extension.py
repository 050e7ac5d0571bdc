"""Our C++ extensions, compiled on first use and loaded once per process.

`LazyExtension` holds what the kernel modules (`kernels.cpu_gemm`, `kernels.cpu_fp32`) share:
the `$PAGEDSERVE_DISABLE_CPU_KERNELS` switch, the x86-64 check, a build folder named by a hash of
the sources, `torch.utils.cpp_extension.load`, a probe op that says which ISA the code can use,
and one warning (never an exception) when the build or the probe fails: callers then use torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"
CSRC = Path(__file__).with_name("csrc")


def kernels_disabled() -> bool:
    """Whether `$PAGEDSERVE_DISABLE_CPU_KERNELS` is set to a true value (read on every call)."""
    raw = os.environ.get(DISABLE_ENV)
    return raw is not None and raw.strip().lower() not in ("", "0", "false", "no", "off")


class LazyExtension:
    """One C++ extension from `sources` (files under csrc/; `headers` they include), built on the
    first `isa()` call (thread-safe) and never at import.

    `probe()` runs after loading and returns the ISA code the extension's ops will use (0 = the
    CPU lacks what they need); `describe(code)` names it in the log line.
    """

    def __init__(self, prefix: str, sources: list[str], headers: list[str], *, cflags: list[str],
                 probe: Callable[[], int], describe: Callable[[int], str]) -> None:
        self.prefix = prefix
        self.sources = [CSRC / name for name in sources]
        self.headers = [CSRC / name for name in headers]
        self.cflags = cflags
        self.probe = probe
        self.describe = describe
        self._isa: int | bool | None = None  # None = not tried, False = unavailable (warned)
        self._lock = threading.Lock()

    def build_name(self) -> str:
        """The extension's name, which is also its build folder: the prefix and a hash of the
        sources and of their folder. NOTE: two source trees on one machine (two checkouts, two
        installed versions) must not share a build folder, even with equal sources: build.ninja
        names the sources by absolute path, so each would rebuild it (minutes) after the other,
        and a process starting in between could load the other tree's library."""
        digest = hashlib.sha1(str(CSRC.resolve()).encode())
        for path in self.sources + self.headers:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        return f"{self.prefix}_{digest.hexdigest()[:12]}"

    def _build(self) -> int:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise RuntimeError(f"not an x86-64 CPU ({platform.machine()})")
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        # NOTE: -fopenmp is required: at::parallel_for is a header template over `#pragma omp
        # parallel`; libgomp then resolves to the copy torch has already loaded (same soname).
        # cpp_extension serialises concurrent builds (other processes too) with a lock file in the
        # build folder; a process killed mid-build leaves it behind and later builds wait on it:
        # delete `$TORCH_EXTENSIONS_DIR/<py>_cpu/<build_name>/lock` if first use hangs.
        cpp_extension.load(
            name=self.build_name(),
            sources=[str(p) for p in self.sources],
            extra_cflags=["-O3", "-fopenmp", *self.cflags],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
            verbose=False,
        )
        isa = int(self.probe())
        if isa == 0:
            raise RuntimeError(f"the CPU (or OS) lacks what {self.prefix} needs")
        logger.info("%s ready in %.1f s (%s)", self.prefix, time.perf_counter() - t0, self.describe(isa))
        return isa

    def isa(self) -> int:
        """The probe's ISA code, building the extension on first call; 0 when disabled or
        unavailable (a failure is logged once, as a warning naming its first line)."""
        if kernels_disabled():
            return 0
        isa = self._isa
        if isa is None:
            with self._lock:
                if self._isa is None:
                    try:
                        self._isa = self._build()
                    except Exception as e:  # noqa: BLE001 -- any failure means: use torch
                        # first line only: a build error carries the whole compiler log (at debug)
                        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                        logger.warning("%s unavailable, using torch: %s", self.prefix, reason)
                        logger.debug("%s failure", self.prefix, exc_info=True)
                        self._isa = False
                isa = self._isa
        return int(isa) if isa else 0
