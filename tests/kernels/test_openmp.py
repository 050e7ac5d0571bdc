"""Releasing the loading thread's OpenMP pool (kernels/openmp.py), as the server does before its
engine thread takes over the model."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, threading, torch
    from pagedserve.kernels.openmp import _loaded_libgomps, release_thread_pool
    torch.set_num_threads(2)
    x = torch.randn(1500, 1500)
    (x @ x).sum()  # a parallel region on this thread: its pool of workers exists now
    before = len(os.listdir("/proc/self/task"))
    assert release_thread_pool()
    after = len(os.listdir("/proc/self/task"))
    out = []
    t = threading.Thread(target=lambda: out.append(float((x @ x).sum())))
    t.start(); t.join()
    assert out and out[0] == float((x @ x).sum())  # the pool comes back on demand, same result
    print(before, after)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP on Linux")
def test_release_thread_pool_frees_this_threads_openmp_workers():
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: no OpenMP workers to free")
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    before, after = map(int, res.stdout.split())
    assert after < before


def test_release_thread_pool_is_a_no_op_without_libgomp(monkeypatch):
    from pagedserve.kernels import openmp

    monkeypatch.setattr(openmp, "_loaded_libgomps", lambda: [])
    assert openmp.release_thread_pool() is False
