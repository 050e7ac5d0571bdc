"""The event loop never blocks: a request's CPU work (tokenizing, rendering, building the
response) runs off the loop, so /health and other requests' streams keep answering while huge
prompts are being tokenized."""

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

LIMIT_S = 0.1
# ~120k tokens of the tiny tokenizer per prompt (several hundred ms to tokenize each).
HUGE = "the quick brown fox jumps over the lazy dog. " * 4500
# NOTE: enough of them that tokenizing takes well over 10 x LIMIT_S on a fast idle machine too
# (8 took 0.92 s on an idle Zen 4)
HUGE_REQUESTS = 16


async def _huge_requests(client: httpx.AsyncClient, count: int) -> list[int]:
    async def one(i: int) -> int:
        if i % 2:
            body = {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4}
            resp = await client.post("/v1/chat/completions", json=body)
        else:
            resp = await client.post("/v1/completions", json={"prompt": HUGE, "max_tokens": 4})
        return resp.status_code

    return await asyncio.gather(*(one(i) for i in range(count)))


async def _poll_health(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    waits = []
    while not stop.is_set():
        t0 = time.perf_counter()
        resp = await client.get("/health")
        waits.append(time.perf_counter() - t0)
        assert resp.status_code == 200
        await asyncio.sleep(0.01)
    return waits


async def _stream_gaps(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    """Stream completions back to back until `stop`; the gaps between their chunks."""
    gaps = []
    while not stop.is_set():
        body = {"prompt": "A list of", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            last = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if line != "data: [DONE]":
                    json.loads(line[6:])
    return gaps


def test_health_and_a_stream_answer_within_100ms_while_huge_prompts_are_tokenized(server):
    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as big, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as small:
            # The stream's own pace on this machine, with nothing else going on.
            stop = asyncio.Event()
            streamer = asyncio.ensure_future(_stream_gaps(small, stop))
            await asyncio.sleep(2.0)
            stop.set()
            baseline = await streamer
            # The same stream while huge prompts arrive.
            stop = asyncio.Event()
            streamer = asyncio.ensure_future(_stream_gaps(small, stop))
            await asyncio.sleep(0.3)
            health = asyncio.ensure_future(_poll_health(small, stop))
            t0 = time.perf_counter()
            codes = await _huge_requests(big, HUGE_REQUESTS)
            busy = time.perf_counter() - t0
            stop.set()
            return codes, busy, await health, baseline, await streamer

    codes, busy, health_waits, baseline, gaps = asyncio.run(main())
    # Far longer than the server's context: tokenized in full, then refused.
    assert codes == [400] * HUGE_REQUESTS
    assert busy > 10 * LIMIT_S, f"the huge prompts took only {busy:.2f} s: the test is too weak"
    assert len(health_waits) > 10 and len(gaps) > 20 and len(baseline) > 5
    # NOTE: the 90th percentile, not the maximum: on a shared CI machine the OS alone stalls a
    # process now and then. A blocked loop fails every sample taken while a prompt is tokenized.
    assert _p90(health_waits) < LIMIT_S, sorted(health_waits)[-10:]
    # The stream keeps its pace: at most 100 ms slower than alone (an engine step of the tiny
    # model takes milliseconds on an idle machine; a loaded one slows the stream by itself).
    assert _p90(gaps) < _p90(baseline) + LIMIT_S, (_p90(baseline), sorted(gaps)[-10:])


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]
