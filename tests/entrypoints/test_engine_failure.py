"""When the engine thread crashes, requests in flight and new ones get a 503 in OpenAI's shape
and /health turns 503 (the app in process, on a tiny engine whose step is made to fail)."""

import argparse
import asyncio

import httpx
import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.timeout(60)


def test_engine_crash_gives_503s_and_an_unhealthy_health_check(small_engine):
    engine = AsyncLLMEngine(small_engine)
    app = build_app(engine, argparse.Namespace())

    def crash():
        raise RuntimeError("simulated device failure")

    async def main():
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            healthy = await c.get("/health")
            ok = await c.post("/v1/completions", json={"prompt": "The module", "max_tokens": 2})
            small_engine.step = crash
            failed = await c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2})
            after = await c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2})
            health = await c.get("/health")
        await engine.shutdown()
        return healthy, ok, failed, after, health

    try:
        healthy, ok, failed, after, health = asyncio.run(main())
    finally:
        del small_engine.step
        for request_id in list(small_engine.groups):
            small_engine.abort_request(request_id)
    assert healthy.status_code == 200 and ok.status_code == 200
    assert failed.status_code == 503 and "simulated device failure" in failed.json()["error"][
        "message"]
    assert after.status_code == 503
    assert health.status_code == 503 and health.json()["error"]["code"] == 503
