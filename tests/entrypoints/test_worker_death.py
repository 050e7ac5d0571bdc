"""A tensor-parallel worker killed under the server: errors, 503 on /health, non-zero exit."""

import os
import signal
import subprocess
import time

import pytest

from server_utils import ServerProcess

pytestmark = pytest.mark.timeout(120)


def _workers(pid: int) -> list[int]:
    """The server's spawned worker processes (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    workers = []
    for child in map(int, out.split()):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            workers.append(child)
    return workers


def test_killed_worker_makes_the_server_fail_cleanly_and_exit_non_zero(tiny_llama, logs):
    server = ServerProcess.start(str(tiny_llama), "--dtype", "float32", "--num-kv-blocks", "64",
                                 "--tensor-parallel-size", "2", log_dir=logs)
    try:
        workers = _workers(server.proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        killed = time.monotonic()
        server.proc.wait(timeout=10)  # exits within 10 s, no hang
        assert time.monotonic() - killed < 10
        assert server.proc.returncode not in (0, None)
        assert "died" in server.log_text().lower() or "worker" in server.log_text().lower()
    finally:
        server.stop(signal.SIGKILL)
