"""Overload and abort storms on real servers (pagedserve.bench.reliability, also run at full
size by scripts/overload.py and scripts/abort_storm.py; figures in docs/reliability.md)."""

import argparse
import asyncio
from http import HTTPStatus

import httpx
import pytest
from server_utils import SERVER_FLAGS, ServerProcess, metric

from pagedserve.bench.reliability import abort_storm, overload, wait_idle
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.timeout(150)

# Small enough that 8 streams of ~60 tokens overflow the GPU pool: preemption (by swapping).
STORM_FLAGS = ["--max-num-seqs", "8", "--num-kv-blocks", "20", "--preemption-mode", "swap",
               "--num-cpu-blocks", "128", "--enable-debug-endpoints", "--log-stats-interval", "0"]


@pytest.fixture(scope="module")
def storm_server(tiny_llama, logs):
    proc = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, *STORM_FLAGS, log_dir=logs)
    yield proc
    assert proc.stop() == 0, proc.log_text()[-3000:]


def test_ten_times_capacity_completes_or_gets_503_retry_after_and_none_is_lost(tiny_llama,
                                                                                logs):
    # Capacity: 2 running + 4 queued; 60 concurrent requests is 10x that.
    proc = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, "--max-num-seqs", "2",
                               "--max-queued-requests", "4", "--enable-debug-endpoints",
                               log_dir=logs)
    try:
        result = asyncio.run(overload(proc.url, 60, max_tokens=16, timeout=60))
        state = asyncio.run(wait_idle(proc.url, timeout=20))
        assert httpx.get(proc.url + "/health").status_code == 200
    finally:
        assert proc.stop() == 0, proc.log_text()[-3000:]
    assert result.lost == 0, result.lost_reasons[:5]
    assert result.completed + result.refused == 60
    # At least the 4 that fit in the queue complete; the rest may be refused.
    assert result.completed >= 4 and result.refused > 0, result
    assert state["used_blocks"] == 0 and state["invariants_ok"]


def test_abort_storm_of_300_streams_leaks_no_blocks_and_leaves_no_request_behind(storm_server):
    url = storm_server.url
    result = asyncio.run(abort_storm(url, 300, concurrency=16, seed=1, timeout=60,
                                     max_prompt_words=30, max_tokens=(2, 20)))
    state = asyncio.run(wait_idle(url, timeout=30))
    text = httpx.get(url + "/metrics").text
    assert not result.errors, result.errors[:5]
    assert result.completed + sum(result.dropped.values()) + result.refused == 300
    # The storm really dropped clients in every phase, under KV pressure (preemptions).
    assert all(n > 0 for n in result.dropped.values()), result.dropped
    assert state["preemptions"] > 0, state
    # Nothing leaked: no request left, no GPU or CPU (swap) block held, invariants hold.
    assert state["invariants_ok"] is True
    assert (state["running"], state["waiting"], state["swapped"], state["groups"]) == (0, 0, 0, 0)
    assert state["used_blocks"] == 0 and state["used_cpu_blocks"] == 0, state
    assert metric(text, "pagedserve:num_requests_running") == 0
    assert metric(text, "pagedserve:num_requests_waiting") == 0
    assert metric(text, "pagedserve:num_requests_swapped") == 0
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0
    after = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 3},
                       timeout=30)
    assert after.status_code == 200


def test_debug_endpoint_is_absent_unless_enabled(http):
    assert http.get("/debug/engine").status_code == 404


def test_a_body_over_max_request_bytes_gets_413_in_openai_shape(small_engine):
    engine = AsyncLLMEngine(small_engine)
    app = build_app(engine, argparse.Namespace(max_request_bytes=1000))

    async def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'", "max_tokens": 1}'

    async def main():
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            declared = await c.post("/v1/completions", json={"prompt": "x" * 2000})
            chunked = await c.post("/tokenize", content=chunks())
            small = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        await engine.shutdown()
        return declared, chunked, small

    declared, chunked, small = asyncio.run(main())
    assert "content-length" not in chunked.request.headers
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == HTTPStatus(413).phrase
        assert "--max-request-bytes" in r.json()["error"]["message"]
    assert small.status_code == 200
