"""Graceful drain (--shutdown-timeout S): on SIGTERM new requests get 503 while those in flight
run on for up to S seconds; then the rest are ended and the server exits 0. (Without the flag,
test_shutdown.py: in-flight requests end at once.)"""

import signal
import threading
import time

import httpx
import pytest

from server_utils import MAX_MODEL_LEN, SERVER_FLAGS, ServerProcess, sse_events

pytestmark = pytest.mark.timeout(300)


def _stream_in_thread(url: str, max_tokens: int):
    """Start a streamed completion in a thread; (thread, lines, first-chunk event)."""
    first_chunk = threading.Event()
    lines: list[str] = []

    def read():
        body = {"prompt": "The module", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    first_chunk.set()

    reader = threading.Thread(target=read)
    reader.start()
    return reader, lines, first_chunk


def _health_once_draining(url: str, timeout: float = 30.0) -> httpx.Response:
    """Poll /health right after the signal until it stops answering 200 (the drain began)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=30)
        if health.status_code != 200 or time.monotonic() > deadline:
            return health
        time.sleep(0.01)


def test_sigterm_with_shutdown_timeout_refuses_new_requests_and_lets_streams_finish(
        tiny_llama, logs):
    server = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, "--shutdown-timeout", "120",
                                 "--root-path", "/api", log_dir=logs)
    try:
        # --root-path: the prefix a proxy strips, advertised to OpenAPI clients.
        spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
        assert {"url": "/api"} in spec["servers"]
        # The longest stream the tiny model allows (~2 s here): the probes below must land
        # while it still runs, or the drained server has already exited.
        reader, lines, first_chunk = _stream_in_thread(server.url, MAX_MODEL_LEN - 32)
        assert first_chunk.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        health = _health_once_draining(server.url)
        refused = httpx.post(server.url + "/v1/completions",
                             json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
        reader.join(120)
        assert not reader.is_alive()
        code = server.proc.wait(60)
    finally:
        server.stop()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    assert health.status_code == 503
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # ran to its end
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) != ""
    assert code == 0, server.log_text()[-3000:]
    assert "drained: every request in flight finished" in server.log_text()


def test_requests_still_running_at_the_shutdown_timeout_are_ended_and_the_exit_is_zero(
        tiny_llama, logs):
    server = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, "--shutdown-timeout", "0.5",
                                 log_dir=logs)
    try:
        readers = [_stream_in_thread(server.url, 480) for _ in range(4)]
        for _, _, first_chunk in readers:
            assert first_chunk.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        for reader, _, _ in readers:
            reader.join(60)
            assert not reader.is_alive()
        code = server.proc.wait(60)
    finally:
        server.stop()
    assert code == 0, server.log_text()[-3000:]
    ended = 0
    for _, lines, _ in readers:
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        last = events[-2]
        # Ended by the drain's timeout (an error chunk), unless it raced to its end.
        if "error" in last:
            assert last["error"]["code"] == 503
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    log = server.log_text()
    assert ended == 0 or "drain timeout: ending" in log
