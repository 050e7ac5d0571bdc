"""When the engine thread crashes, requests in flight and new ones get a 503 in OpenAI's shape
and /health turns 503 (the app in process, on a tiny engine whose step is made to fail).
When one model step raises, only its requests fail (500) and the engine keeps serving."""

import argparse
import asyncio
import logging

import httpx
import pytest
from server_utils import metric

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


POISON = 7  # a prompt holding this token id makes the (patched) model step raise


def _poison_the_model(monkeypatch, llm):
    """Make the model step raise whenever a scheduled sequence holds the POISON token."""
    real = llm.executor.execute

    def execute(step):
        if any(POISON in row.token_ids for row in step.rows):
            raise RuntimeError("simulated kernel fault on a poisoned batch")
        return real(step)

    monkeypatch.setattr(llm.executor, "execute", execute)


def test_a_failing_model_step_fails_only_its_requests_with_500_and_the_engine_keeps_serving(
        small_engine, monkeypatch, caplog):
    _poison_the_model(monkeypatch, small_engine)
    engine = AsyncLLMEngine(small_engine)
    app = build_app(engine, argparse.Namespace())
    poisoned = {"prompt": [1, POISON, 3], "max_tokens": 4}

    async def main():
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            failed = await c.post("/v1/completions", json=poisoned)
            streamed = await c.post("/v1/completions", json={**poisoned, "stream": True})
            chat_ok = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            ok = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
            health = await c.get("/health")
            metrics = await c.get("/metrics")
        await engine.shutdown()
        return failed, streamed, chat_ok, ok, health, metrics

    with caplog.at_level(logging.ERROR, logger="pagedserve"):
        failed, streamed, chat_ok, ok, health, metrics = asyncio.run(main())
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "InternalServerError" and "simulated kernel fault" in error["message"]
    assert streamed.status_code == 200  # the stream had started: its error is an SSE event
    assert '"code":500' in streamed.text and "simulated kernel fault" in streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert chat_ok.status_code == 200 and ok.status_code == 200, (chat_ok.text, ok.text)
    assert len(ok.json()["choices"][0]["text"]) > 0
    assert health.status_code == 200 and not engine.errored
    # The failed requests' blocks went back to the pool; the logged error has its traceback.
    assert small_engine.num_used_blocks() == 0 and not small_engine.groups
    small_engine.check_invariants()
    logged = [r for r in caplog.records if "model step failed" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)
    assert metric(metrics.text, "pagedserve:request_success_total", finished_reason="abort") == 2


def test_a_failing_step_fails_the_requests_batched_with_the_poisoned_one_but_not_later_ones(
        small_engine, monkeypatch):
    _poison_the_model(monkeypatch, small_engine)
    engine = AsyncLLMEngine(small_engine)
    app = build_app(engine, argparse.Namespace())

    async def main():
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            batch = await asyncio.gather(*(
                c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
                for prompt in ([1, 2, POISON], [1, 2, 4], [5, 6, 8])
            ))
            after = await c.post("/v1/completions", json={"prompt": [1, 2, 4], "max_tokens": 4})
        await engine.shutdown()
        return batch, after

    batch, after = asyncio.run(main())
    codes = [r.status_code for r in batch]
    assert codes[0] == 500 and set(codes) <= {200, 500}, codes
    assert after.status_code == 200 and not engine.errored
    assert small_engine.num_used_blocks() == 0
    small_engine.check_invariants()
