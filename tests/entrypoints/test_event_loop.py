"""The event loop never blocks on a request's CPU work: tokenizing and chat rendering run off the
loop, so /health and other requests' streams keep answering while a prompt is being tokenized.

No duration is asserted (speed is for benchmarks): the first test counts, per thread, the calls
that tokenize and render; the second holds one prompt inside the tokenizer and checks that
/health and a running stream answer meanwhile. A blocked loop fails both by what happened, not by
how long it took; the waits below are only hang guards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai import serving_chat
from pagedserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.timeout(300)

HANG_GUARD_S = 30.0


@contextlib.contextmanager
def _server_thread(llm):
    """The app on `llm`, served by uvicorn on its own thread (its event loop) and a free port:
    yields (base url, the loop thread's ident)."""
    engine = AsyncLLMEngine(llm)
    app = build_app(engine, argparse.Namespace())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", thread.ident
    finally:
        server.should_exit = True
        thread.join(HANG_GUARD_S)
        sock.close()
        for request_id in list(llm.groups):
            llm.abort_request(request_id)


def _record_threads(monkeypatch, tokenizer) -> dict[str, list[int]]:
    """Patch the tokenizer's `__call__` and the chat rendering to record the thread of each call."""
    seen: dict[str, list[int]] = {"tokenize": [], "render": []}
    tokenize, render = type(tokenizer).__call__, serving_chat.render_chat

    def recording_tokenize(self, *args, **kwargs):
        seen["tokenize"].append(threading.get_ident())
        return tokenize(self, *args, **kwargs)

    def recording_render(*args, **kwargs):
        seen["render"].append(threading.get_ident())
        return render(*args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording_tokenize)
    monkeypatch.setattr(serving_chat, "render_chat", recording_render)
    return seen


def test_tokenizing_and_chat_rendering_never_run_on_the_event_loop(small_engine, monkeypatch):
    seen = _record_threads(monkeypatch, small_engine.tokenizer)
    with _server_thread(small_engine) as (url, loop_thread), \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
        completion = http.post("/v1/completions", json={"prompt": "the quick brown fox " * 3,
                                                        "max_tokens": 2})
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "the lazy dog " * 3}], "max_tokens": 2})
        tokenized = http.post("/tokenize", json={"prompt": "jumps over"})
    assert [completion.status_code, chat.status_code, tokenized.status_code] == [200] * 3
    assert len(seen["tokenize"]) >= 3 and len(seen["render"]) >= 1, seen
    on_loop = {k: v.count(loop_thread) for k, v in seen.items()}
    assert on_loop == {"tokenize": 0, "render": 0}, on_loop


def _data_lines(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_health_and_a_running_stream_answer_while_a_prompt_is_held_in_the_tokenizer(
        small_engine, monkeypatch):
    tokenize = type(small_engine.tokenizer).__call__
    inside, release = threading.Event(), threading.Event()
    timed_out: list[bool] = []

    def held_tokenize(self, text, *args, **kwargs):
        if isinstance(text, str) and text.startswith("HELD"):
            inside.set()
            # NOTE: on a blocked loop nothing can set `release`: the wait then times out, and
            # the test fails on `timed_out` (as well as on /health's hang guard).
            timed_out.append(not release.wait(2 * HANG_GUARD_S))
        return tokenize(self, text, *args, **kwargs)

    monkeypatch.setattr(type(small_engine.tokenizer), "__call__", held_tokenize)
    with _server_thread(small_engine) as (url, _), \
            httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http, \
            httpx.Client(base_url=url, timeout=3 * HANG_GUARD_S) as held_client:
        body = {"prompt": "A list of", "max_tokens": 48, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            chunks = _data_lines(stream)
            first = next(chunks)  # the stream is running
            held: dict = {}
            poster = threading.Thread(target=lambda: held.update(resp=held_client.post(
                "/v1/completions", json={"prompt": "HELD " * 8, "max_tokens": 2})))
            poster.start()
            assert inside.wait(HANG_GUARD_S), "the held prompt never reached the tokenizer"
            health = http.get("/health")
            more = [next(chunks) for _ in range(5)]
            still_held = not release.is_set() and poster.is_alive()
            release.set()
            rest = list(chunks)
        poster.join(3 * HANG_GUARD_S)
    assert health.status_code == 200
    assert still_held and timed_out == [False]
    finishes = [c["choices"][0].get("finish_reason") for c in [first, *more, *rest]]
    assert len(more) == 5 and finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert held["resp"].status_code == 200
