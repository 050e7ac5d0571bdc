"""Helpers of the server tests: the server subprocess, the shared server's options, parsing
Prometheus text and SSE streams."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# The shared server's options; tests that depend on them import these.
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 1024
BLOCK_SIZE = 16
SERVER_FLAGS = [
    "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks",
    str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--seed", "0",
    "--disable-access-log", "--log-stats-interval", "1",
]
# tool_choice "auto"; compact JSON (a random model writes whitespace without end otherwise):
# tests/entrypoints/test_tool_calls.py, test_server_structured_outputs.py
SERVER_FLAGS += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--structured-outputs-disable-any-whitespace"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `pagedserve serve` subprocess; its output goes to a log file."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, model: str):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.model = model

    @classmethod
    def start(cls, model: str | None, *flags: str, log_dir: Path, timeout: float = 120.0):
        port = free_port()
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve"]
        cmd += [model] if model else []
        cmd += ["--port", str(port), *flags]
        log_path = log_dir / f"server-{port}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - owned by the process's lifetime
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, model or "gemma-3-270m")
        server.wait_ready(timeout)
        return server

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (labels matched as given)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{labels} not in the metrics")


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream, then the string "[DONE]" if it came."""
    import json

    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def worker_pids(pid: int) -> list[int]:
    """A server's spawned tensor-parallel worker processes (not multiprocessing's resource
    tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    found = []
    for child in map(int, out.split()):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except OSError:  # exited meanwhile
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(child)
    return found
