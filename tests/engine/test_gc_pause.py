"""The garbage collector paused for an engine step (engine/gc_pause.py)."""

import gc
import weakref

import pytest

from pagedserve.engine.gc_pause import gc_paused


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_collector_is_paused_inside_and_enabled_again_after_even_on_error(gc_enabled):
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("step failed")
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled(gc_enabled):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_what_the_body_allocated_is_collected_after_it(gc_enabled):
    gc.collect()
    freed = []
    with gc_paused():
        cycle = _Cycle()
        weakref.finalize(cycle, freed.append, True)
        del cycle
        keep = [[] for _ in range(gc.get_threshold()[0] + 10)]  # past the youngest threshold
        assert freed == []  # no collection inside
    assert freed == [True]  # the collection its allocations started ran as it ended
    assert gc.get_count()[0] < gc.get_threshold()[0]
    del keep


def test_no_collection_starts_while_an_engine_step_runs(gc_enabled, tmp_path):
    # Regression (issue 25): with the collector running, a step's short-lived rows and outputs
    # started collections mid-step and were promoted, and full collections walked the heap.
    from pagedserve.bench import step_overhead as so
    from pagedserve.sampling_params import SamplingParams

    engine = so.build_engine(str(so.tiny_llama_folder(tmp_path / "m")), max_seqs=256,
                             prompt_len=8, steps=4, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    for i in range(256):
        engine.add_request(str(i), None, params, prompt_token_ids=[1, 5 + i % 500, 7])
    inside, during = [False], []
    run_step = engine._run_step

    def marked():
        inside[0] = True
        try:
            return run_step()
        finally:
            inside[0] = False

    def on_gc(phase, info):
        if phase == "start" and inside[0]:
            during.append(info["generation"])

    engine._run_step = marked  # the step's body, inside the pause
    gc.callbacks.append(on_gc)
    try:
        while engine.has_unfinished_requests():  # a step builds thousands of objects here
            engine.step()
    finally:
        gc.callbacks.remove(on_gc)
        engine.shutdown()
    assert during == []


def test_the_startup_heap_is_frozen_once_per_process_and_later_cycles_are_still_collected():
    """freeze_startup_heap: the first call collects and freezes (a fresh process: nothing frozen
    yet), later calls do nothing, and garbage made after it is collected as before."""
    import subprocess
    import sys

    code = """
import gc, weakref
from pagedserve.engine.gc_pause import freeze_startup_heap
class C:
    def __init__(self): self.me = self
assert gc.get_freeze_count() == 0
assert freeze_startup_heap() is True
frozen = gc.get_freeze_count()
assert frozen > 0
assert freeze_startup_heap() is False and gc.get_freeze_count() == frozen
c = C(); r = weakref.ref(c); del c
gc.collect()
assert r() is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
