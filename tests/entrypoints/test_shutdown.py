"""SIGTERM: the server stops accepting, ends in-flight streams (an error chunk, then [DONE]) and
exits 0. (SIGINT takes the same path; the guarded server of test_auth_and_limits.py is stopped
with it and must exit 0 too.)"""

import signal
import threading

import httpx
import pytest

from server_utils import SERVER_FLAGS, ServerProcess, sse_events

pytestmark = pytest.mark.timeout(90)


def test_sigterm_ends_in_flight_streams_stops_accepting_and_exits_zero(tiny_llama, logs):
    server = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, log_dir=logs)
    try:
        first_chunk = threading.Event()
        lines = []

        def read():
            body = {"prompt": "The module", "max_tokens": 500, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=30) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        first_chunk.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first_chunk.wait(20)
        server.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive()
        code = server.proc.wait(30)
    finally:
        server.stop()
    assert code == 0, server.log_text()[-3000:]
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    last = events[-2]
    # Ended early: with an error chunk (or, had it raced to its end, a finish reason).
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    if "error" in last:
        assert last["error"]["code"] == 503
        assert sum(1 for e in events[:-2] if e["choices"][0]["text"]) < 500
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
