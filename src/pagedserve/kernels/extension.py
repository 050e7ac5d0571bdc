"""Our C++ extensions: prebuilt in a wheel, else compiled on first use, loaded once per process.

`LazyExtension` holds what the kernel modules (`kernels.cpu_gemm`, `kernels.cpu_fp32`,
`kernels.cpu_grammar`) share: the `$PAGEDSERVE_DISABLE_CPU_KERNELS` switch, the x86-64 check, a
probe op that says which ISA the code can use, and how the library is found:

1. prebuilt: an installed wheel carries the libraries, compiled at wheel build from the same
   declarations (`setup.py`, `kernels.build`) into `kernels/_prebuilt/`. One is loaded when it
   was compiled from the very sources installed beside it and against this process's torch
   version; a torch mismatch is logged as an ERROR naming both versions (the C++ ABI differs).
2. JIT (source checkouts, editable installs, or a prebuilt library that does not fit):
   `torch.utils.cpp_extension.load` into a build folder named by a hash of the sources, of their
   folder and of torch's; the start of a build is logged ("building CPU kernels for this
   machine, once, ~N s") and its progress every few seconds.
3. neither (no compiler, a build error, a CPU without what the code needs): one WARNING with the
   reason and what the torch fallback costs; callers then use torch. `require_kernels()` (the
   engine's `require_kernels` option) makes that an error instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable

from pagedserve.kernels.build import (
    BASE_CFLAGS,
    BASE_LDFLAGS,
    KernelsUnavailableError,
    PREBUILT_DIR,
    content_digest,
    declared_extensions,
    jit_build_name,
    read_build_info,
)
from pagedserve.kernels.build import CSRC as _CSRC

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"
CSRC = _CSRC
PROGRESS_EVERY_S = 10.0
# A JIT build's duration, for the log line: seconds per source file on one core (gcc -O3 over
# torch's headers; measured on a 2-core Zen 4: the 7-source main library takes ~45 s).
_SECONDS_PER_SOURCE_CORE = 12.0


def kernels_disabled() -> bool:
    """Whether `$PAGEDSERVE_DISABLE_CPU_KERNELS` is set to a true value (read on every call)."""
    raw = os.environ.get(DISABLE_ENV)
    return raw is not None and raw.strip().lower() not in ("", "0", "false", "no", "off")


def _public_version(version: str) -> str:
    """"2.13.0+cpu" -> "2.13.0" (CPU and CUDA builds of one torch release share the C++ ABI)."""
    return version.split("+", 1)[0]


class LazyExtension:
    """One C++ extension from `sources` (files under csrc/; `headers` they include), loaded on the
    first `isa()` call (thread-safe) and never at import: the wheel's prebuilt library, else a
    JIT build (see the module docstring).

    `probe()` runs after loading and returns the ISA code the extension's ops will use (0 = the
    CPU lacks what they need); `describe(code)` names it in the log line. `fallback_cost` says
    what running without it costs (the warning's end). After the first `isa()`, `origin` is
    "prebuilt" or "jit" (None when unavailable; then `failure` holds the reason).
    """

    def __init__(self, prefix: str, sources: list[str], headers: list[str], *, cflags: list[str],
                 probe: Callable[[], int], describe: Callable[[int], str],
                 fallback_cost: str = "") -> None:
        self.prefix = prefix
        self.sources = [CSRC / name for name in sources]
        self.headers = [CSRC / name for name in headers]
        self.cflags = cflags
        self.probe = probe
        self.describe = describe
        self.fallback_cost = fallback_cost
        self.origin: str | None = None
        self.library: Path | None = None
        self.failure: str | None = None
        self.torch_mismatch: str | None = None  # set when a prebuilt library was refused for it
        self._isa: int | bool | None = None  # None = not tried, False = unavailable (warned)
        self._lock = threading.Lock()

    def digest(self) -> str:
        """The hash of the sources, headers and flags (recorded in a wheel's build_info.json)."""
        return content_digest(self.sources, self.headers, self.cflags)

    def build_name(self) -> str:
        """The JIT library's name, which is also its build folder: the prefix and a hash of the
        sources, of their folder and of the torch installation. NOTE: two source trees on one
        machine (two checkouts, two installed versions) must not share a build folder, even with
        equal sources: build.ninja names the sources by absolute path, so each would rebuild it
        (minutes) after the other, and a process starting in between could load the other
        tree's library. Two venvs (two torch builds) get their own folders for the same reason."""
        import torch

        return jit_build_name(self.prefix, CSRC, Path(torch.__file__).parent, torch.__version__,
                              self.digest())

    def _load_prebuilt(self) -> bool:
        """Load the wheel's library when it fits these sources and this torch; False (logged)
        when there is none or it does not fit."""
        info = read_build_info(PREBUILT_DIR)
        entry = (info or {}).get("extensions", {}).get(self.prefix)
        if info is None or entry is None:
            return False  # a source checkout (or a wheel built without this extension)
        import torch

        if entry.get("digest") != self.digest():
            logger.info("%s: the prebuilt library was compiled from other sources than those "
                        "installed beside it; building it from these", self.prefix)
            return False
        built = str(info.get("torch", "?"))
        if _public_version(built) != _public_version(torch.__version__):
            self.torch_mismatch = (
                f"pagedserve's prebuilt {self.prefix} was compiled against torch {built}, but this "
                f"process runs torch {torch.__version__} (a different C++ ABI), so it is not "
                f"loaded: install the torch it was built for (pip install "
                f"torch=={_public_version(built)}) or build pagedserve for this torch "
                f"(pip wheel . in a checkout)")
            logger.error("%s; building the kernels for this torch instead", self.torch_mismatch)
            return False
        path = PREBUILT_DIR / entry["file"]
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            logger.warning("%s: the prebuilt library %s does not load (%s); building it instead",
                           self.prefix, path, str(e).strip().splitlines()[0])
            return False
        self.origin, self.library = "prebuilt", path
        return True

    def _jit(self) -> None:
        """Compile (or reuse an earlier compile of) the library with cpp_extension and load it."""
        from torch.utils import cpp_extension

        name = self.build_name()
        folder = Path(cpp_extension._get_build_directory(name, False))
        done = folder / f"{name}.so"
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count()) or 1
        n = len(self.sources)
        stop = threading.Event()
        if not done.exists():
            estimate = _SECONDS_PER_SOURCE_CORE * n / max(1, min(cores, n))
            hint = "" if self.torch_mismatch else "; a wheel install ships them prebuilt"
            logger.info("building CPU kernels for this machine, once, ~%.0f s (%s: %d sources, %d "
                        "cores, into %s%s)", estimate, self.prefix, n, cores, folder, hint)
            threading.Thread(target=self._report_progress, args=(folder, n, stop),
                             name=f"{self.prefix}-build-progress", daemon=True).start()
        # cpp_extension serialises concurrent builds (other processes too) with a lock file in the
        # build folder; a process killed mid-build leaves it behind and later builds wait on it:
        # delete `<that folder>/lock` if first use hangs.
        try:
            cpp_extension.load(
                name=name,
                sources=[str(p) for p in self.sources],
                extra_cflags=[*BASE_CFLAGS, *self.cflags],
                extra_ldflags=list(BASE_LDFLAGS),
                extra_include_paths=[str(CSRC)],
                is_python_module=False,
                verbose=False,
            )
        finally:
            stop.set()
        self.origin, self.library = "jit", done

    def _report_progress(self, folder: Path, total: int, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        while not stop.wait(PROGRESS_EVERY_S):
            compiled = len(list(folder.glob("*.o")))
            logger.info("building %s: %d/%d sources compiled, %.0f s", self.prefix,
                        min(compiled, total), total, time.perf_counter() - t0)

    def _build(self) -> int:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise RuntimeError(f"not an x86-64 CPU ({platform.machine()})")
        t0 = time.perf_counter()
        if not self._load_prebuilt():
            self._jit()
        isa = int(self.probe())
        if isa == 0:
            raise RuntimeError(f"the CPU (or OS) lacks what {self.prefix} needs")
        logger.info("%s ready in %.1f s (%s, %s)", self.prefix, time.perf_counter() - t0,
                    self.origin, self.describe(isa))
        return isa

    def isa(self) -> int:
        """The probe's ISA code, loading the extension on first call; 0 when disabled or
        unavailable (a failure is logged once, as a WARNING naming its first line and the
        fallback's cost)."""
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
                        self.failure = reason
                        cost = f": {self.fallback_cost}" if self.fallback_cost else ""
                        logger.warning("%s unavailable (%s); running the torch fallback%s",
                                       self.prefix, reason, cost)
                        logger.debug("%s failure", self.prefix, exc_info=True)
                        self.origin = None
                        self._isa = False
                isa = self._isa
        return int(isa) if isa else 0

    def status(self) -> dict:
        """What `pagedserve collect-env` reports (loads the extension first)."""
        isa = self.isa()
        return {"prefix": self.prefix, "origin": self.origin if isa else None,
                "isa": self.describe(isa) if isa else None, "library": self.library,
                "failure": ("disabled by $" + DISABLE_ENV) if kernels_disabled() else self.failure}


def all_extensions() -> list[LazyExtension]:
    """Every declared extension (`kernels.build.declared_extensions`), from its module."""
    found = []
    for decl in declared_extensions():
        module = importlib.import_module(decl.module)
        found += [v for v in vars(module).values()
                  if isinstance(v, LazyExtension) and v.prefix == decl.prefix]
    return found


def require_kernels() -> None:
    """Load every extension; KernelsUnavailableError (a RuntimeError) naming each one that cannot load, and why (the
    engine's `require_kernels` option: no silent torch fallback)."""
    missing = []
    for ext in all_extensions():
        if not ext.isa():
            why = f"disabled by ${DISABLE_ENV}" if kernels_disabled() else ext.failure
            missing.append(f"{ext.prefix}: {why}")
    if missing:
        raise KernelsUnavailableError("require_kernels: the compiled CPU kernels are unavailable ("
                           + "; ".join(missing) + "); install the pagedserve wheel, or a C++ "
                           "compiler for the JIT build, or drop --require-kernels to run the "
                           "torch fallback")
