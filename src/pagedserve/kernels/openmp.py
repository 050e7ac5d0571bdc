"""OpenMP thread pools when the model runs in a thread other than the one that loaded it.

torch's CPU ops (and our kernels, through `at::parallel_for`) run on GNU OpenMP, which keeps one
pool of worker threads per thread that starts parallel regions. The server loads the model on the
main thread and then steps it on its engine thread, so two pools exist; with more OpenMP threads
than cores, libgomp stops spinning between parallel regions and every region of the engine's pool
pays a futex wake-up, which slows every decode step (docs/benchmarks.md, "Measurements behind
design choices"). `release_thread_pool()` frees the calling thread's pool
(`omp_pause_resource_all(omp_pause_hard)`, OpenMP 5.0), leaving the engine thread's alone.
"""

from __future__ import annotations

import ctypes
import logging
import re

logger = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2


def _loaded_libgomps() -> list[str]:
    """Paths of every libgomp this process has loaded (torch's; wheels such as sentencepiece
    bring their own copy), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            found = re.findall(r"\S*/libgomp[^/\s]*\.so[^/\s]*", f.read())
    except OSError:  # not Linux
        return []
    return sorted(set(found))


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads, in every GNU OpenMP runtime loaded (they
    are recreated if this thread runs a parallel region again). Call it on the thread that loaded
    the model, once the model is handed to another thread, never inside a parallel region.
    Returns whether it happened; a no-op without GNU OpenMP (other runtimes, other systems)."""
    released = False
    for path in _loaded_libgomps():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        released |= pause(_OMP_PAUSE_HARD) == 0
    logger.debug("released this thread's OpenMP pools: %s", released)
    return released


def bind_compute_threads(cpus: list[int]) -> int:
    """Pin the calling thread's OpenMP compute team, thread t to `cpus[t]` (the caller to the
    first; torch's thread count becomes len(cpus)); returns how many threads were pinned (0 when
    the compiled kernels are unavailable: nothing is changed then). NOTE: GNU OpenMP keeps a pool
    per thread that starts parallel regions: call it on the thread that will run the model."""
    from pagedserve.kernels.cpu_gemm import kernel_available

    if not kernel_available():
        logger.warning("cpu_threads_bind: the compiled kernels are unavailable; threads not pinned")
        return 0
    import torch

    pinned = int(torch.ops.pagedserve_cpu.bind_threads(list(cpus)))
    logger.info("compute threads pinned to CPUs %s (%d of %d)", cpus, pinned, len(cpus))
    return pinned
