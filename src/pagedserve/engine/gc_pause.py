"""The cyclic garbage collector paused for one engine step (`LLMEngine.step`).

A step builds a few short-lived objects per running sequence (scheduled rows, step input rows,
results, outputs): at 1024 sequences some 25 thousand. With the collector running, each 700 of
them start a collection of the youngest generation while the step still holds them, so they are
promoted, and every few steps a full collection walks the whole heap (the model's and the
libraries' objects too: 300 thousand and more): tens of milliseconds in one step. Reference
counting frees them anyway once the step drops them; only cycles need the collector.

So the collector is paused while the step runs. Once it has ended, the collection that its
allocations would have started runs at the next allocation (at the latest as the step returns),
by Python's own policy, over what the step left alive: its short-lived objects are gone by then.

NOTE: `gc` is process-wide. A collector that was disabled (by the application, or by another
thread's step) is left as it was; one that was enabled is enabled again after the step, even if
the step raised.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["freeze_startup_heap", "gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the cyclic garbage collector paused (see the module docstring)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def freeze_startup_heap() -> bool:
    """Once per process, when an engine is ready: collect, then `gc.freeze()` what is left (the
    libraries' and the model's objects) into the collector's permanent generation, so that full
    collections no longer walk it (vLLM's engine core does the same). Returns whether it froze.

    NOTE: only the first engine of a process freezes (`gc.get_freeze_count()` is 0 until then):
    frozen objects are never collected, so freezing again for every engine (a test session builds
    hundreds) would keep each dropped engine's reference cycles alive. What was frozen is still
    freed by reference counting."""
    if gc.get_freeze_count() or not gc.isenabled():
        return False
    gc.collect()
    gc.freeze()
    return True
