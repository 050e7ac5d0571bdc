"""A tensor-parallel worker killed under the server: errors, 503 on /health, non-zero exit."""

import os
import signal

import pytest

from server_utils import ServerProcess, worker_pids

pytestmark = pytest.mark.timeout(120)


def test_killed_worker_makes_the_server_fail_cleanly_and_exit_non_zero(tiny_llama, logs):
    server = ServerProcess.start(str(tiny_llama), "--dtype", "float32", "--num-kv-blocks", "64",
                                 "--tensor-parallel-size", "2", log_dir=logs)
    try:
        workers = worker_pids(server.proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        server.proc.wait(timeout=30)  # a hang guard: it exits, it does not hang
        assert server.proc.returncode not in (0, None)
        assert "died" in server.log_text().lower() or "worker" in server.log_text().lower()
    finally:
        server.stop(signal.SIGKILL)
