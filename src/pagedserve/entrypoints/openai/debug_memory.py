"""Where this process's memory goes, for the memory debug endpoints (`--enable-debug-endpoints`:
GET /debug/memory, POST /debug/memory/trim, POST /debug/tracemalloc/start, GET
/debug/tracemalloc/snapshot) that scripts/soak.py reads; see docs/reliability.md "Soak".

Pure functions of this process's state (Linux /proc, glibc malloc where present); the server
passes in the engine's KV cache tensors and parameters and keeps the tracemalloc baseline.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import ctypes.util
import gc
import os
import tracemalloc
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import Any

SMAPS_KINDS = ("heap", "kv", "weights", "anon", "file", "stack", "other")


def memory_report(kv_tensors: Iterable, param_tensors: Iterable, objects: int = 0) -> dict:
    """GET /debug/memory: `rss`, `smaps` (`smaps_rss`), `malloc` (`malloc_state`) and, with
    `objects` > 0, `objects` (`object_counts(objects)`)."""
    state: dict[str, Any] = {"rss": rss_now(), "smaps": smaps_rss(kv_tensors, param_tensors),
                             "malloc": malloc_state()}
    if objects > 0:
        state["objects"] = object_counts(objects)
    return state


def trim() -> dict[str, int]:
    """POST /debug/memory/trim: `gc.collect()` + glibc `malloc_trim(0)` (the loader does the
    trim after loading) and this process's RSS before and after: how much of it malloc was holding
    freed. Call it on the engine thread, between steps."""
    from pagedserve.models.loader import release_freed_memory

    before = rss_now()
    release_freed_memory(collect_garbage=True)
    return {"rss_before": before, "rss_after": rss_now()}


def rss_now() -> int:
    """This process's resident bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tensor_starts(kv_tensors: Iterable, param_tensors: Iterable) -> list[tuple[int, str]]:
    """(data pointer, "kv" or "weights") of the KV cache tensors and of the parameters (those on
    the CPU and not empty), sorted."""
    starts = [(t.data_ptr(), "kv") for t in kv_tensors]
    starts += [(t.data_ptr(), "weights") for t in param_tensors
               if t.device.type == "cpu" and t.numel()]
    return sorted(starts)


def smaps_rss(kv_tensors: Iterable = (), param_tensors: Iterable = ()) -> dict[str, int]:
    """This process's resident bytes by mapping: `heap` (the main arena, brk), `kv` and
    `weights` (anonymous mappings holding one of `kv_tensors` or `param_tensors`: glibc maps
    large blocks on their own), `anon` (other anonymous mappings: other malloc arenas, large
    malloc blocks, Python's arenas), `file` (libraries, mapped files), `stack`, `other`."""
    starts = tensor_starts(kv_tensors, param_tensors)
    ptrs = [p for p, _ in starts]
    kinds = dict.fromkeys(SMAPS_KINDS, 0)
    kind = "other"
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header
                parts = line.split(None, 5)
                name = parts[5].strip() if len(parts) > 5 else ""
                kind = ("anon" if not name else "heap" if name == "[heap]"
                        else "file" if name.startswith("/")
                        else "stack" if name.startswith("[stack") else "other")
                if kind == "anon":
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    i = bisect.bisect_left(ptrs, lo)
                    if i < len(ptrs) and ptrs[i] < hi:
                        kind = starts[i][1]
            elif first == "Rss:":
                kinds[kind] += int(line.split()[1]) * 1024
    return kinds


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_state() -> dict[str, Any]:
    """glibc malloc's view: `mallinfo2()` (in use, free inside the arenas, mmapped chunks) and
    per-arena system/free bytes from `malloc_info()`; {} elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2, libc.malloc_info, libc.open_memstream  # noqa: B018
    except (OSError, AttributeError):  # not glibc (or glibc < 2.33)
        return {}

    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                    ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    text = ctypes.string_at(buf.value, size.value).decode()
    libc.free(buf)
    arenas = []
    for heap in ET.fromstring(text).findall("heap"):
        free = sum(int(t.get("size", 0)) for t in heap.findall("total"))
        system = next((int(s.get("size", 0)) for s in heap.findall("system")
                       if s.get("type") == "current"), 0)
        arenas.append({"nr": int(heap.get("nr", -1)), "system": system, "free": free})
    return {
        "in_use": info.uordblks,  # allocated from the arenas
        "free_in_arenas": info.fordblks,  # freed but kept by malloc
        "top_releasable": info.keepcost,  # what malloc_trim could cut off the top
        "arena_system": info.arena,  # obtained from the OS for the arenas
        "mmapped": info.hblkhd,  # large chunks mmapped on their own
        "mmapped_count": info.hblks,
        "arenas": arenas,
    }


def object_counts(top: int) -> dict[str, int]:
    """The `top` most common types (qualified names) of the objects the garbage collector
    tracks, with their counts."""
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    return dict(counts.most_common(top))


# --- tracemalloc ---------------------------------------------------------------------------------


def tracemalloc_start(frames: int = 1) -> tracemalloc.Snapshot:
    """POST /debug/tracemalloc/start: start tracing Python allocations `frames` deep
    (restarting a running trace) and return a first snapshot to compare against. ValueError
    unless 1 <= frames <= 64."""
    if not 1 <= frames <= 64:
        raise ValueError("frames must be between 1 and 64")
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    tracemalloc.start(frames)
    return tracemalloc.take_snapshot()


def tracemalloc_snapshot(first: tracemalloc.Snapshot | None, top: int = 20,
                         stop: bool = False) -> dict[str, Any]:
    """GET /debug/tracemalloc/snapshot: the traced and peak bytes, the growth since `first`
    (from `tracemalloc_start`) and its `top` allocation sites by growth (Python objects and
    buffers only: tensor storage is not traced); `stop` ends the trace. ValueError when no
    trace is running."""
    if first is None or not tracemalloc.is_tracing():
        raise ValueError("no trace is running: POST /debug/tracemalloc/start first")
    now = tracemalloc.take_snapshot()
    traced, peak = tracemalloc.get_traced_memory()
    if stop:
        tracemalloc.stop()
    filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = now.filter_traces(filters).compare_to(first.filter_traces(filters), "traceback")
    sites = [{"size_diff": d.size_diff, "size": d.size, "count_diff": d.count_diff,
              "count": d.count, "traceback": [f"{fr.filename}:{fr.lineno}"
                                              for fr in d.traceback]}
             for d in diff[:max(top, 0)]]
    return {"traced": traced, "peak": peak, "traced_growth": sum(d.size_diff for d in diff),
            "top": sites}
