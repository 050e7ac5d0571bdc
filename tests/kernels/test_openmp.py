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


BIND_SCRIPT = textwrap.dedent("""
    import os, threading, torch
    from pagedserve.kernels.cpu_gemm import kernel_available
    from pagedserve.kernels.openmp import bind_compute_threads
    if not kernel_available():
        print("skip"); raise SystemExit
    cpus = sorted(os.sched_getaffinity(0))
    res = {}
    def pinned_tasks():
        n = 0
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as f:
                allowed = next(l for l in f if l.startswith("Cpus_allowed_list:")).split()[1]
            n += "," not in allowed and "-" not in allowed
        return n
    def run():
        res["pinned"] = bind_compute_threads(cpus)
        res["mine"] = sorted(os.sched_getaffinity(0))
        x = torch.randn(800, 800)
        res["sum"] = float((x @ x).sum())  # regions of the pinned team still run
        # NOTE: counted while this thread lives: its OpenMP workers end with it
        res["tasks"] = pinned_tasks()
    t = threading.Thread(target=run)
    t.start(); t.join()
    print(res["pinned"], len(cpus), res["mine"] == cpus[:1], res["tasks"] >= len(cpus), res["sum"] == res["sum"])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP on Linux")
def test_bind_compute_threads_pins_the_calling_threads_team_one_cpu_each():
    out = subprocess.run([sys.executable, "-c", BIND_SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "skip":
        pytest.skip("compiled kernels unavailable")
    pinned, n, mine, workers, ok = out.stdout.split()
    assert pinned == n and mine == "True" and workers == "True" and ok == "True", out.stdout


def test_cpu_threads_bind_is_validated_naming_the_option():
    from pagedserve.config import EngineArgs, parse_cpu_list

    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("auto", limit=1) == parse_cpu_list("auto")[:1]
    for bad in ("x", "1-0", "0,0", "100000"):
        with pytest.raises(ValueError, match="cpu_threads_bind"):
            EngineArgs(cpu_threads_bind=bad)
