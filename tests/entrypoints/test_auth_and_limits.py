"""`--api-key` on a real server (every route but /health, /metrics too), `--max-queued-requests`
(503 + Retry-After), and `--no-protect-metrics` (in process)."""

import argparse
import asyncio
import signal

import httpx
import pytest

from server_utils import SERVER_FLAGS, ServerProcess

pytestmark = pytest.mark.timeout(60)

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def guarded(tiny_llama, logs):
    # max-queued-requests 0: every generation request is refused, deterministically.
    proc = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, "--api-key", KEY,
                               "--max-queued-requests", "0", "--served-model-name", "tiny",
                               "alias", log_dir=logs)
    yield proc
    # SIGINT (Ctrl-C) shuts down as gracefully as SIGTERM (see test_shutdown.py).
    assert proc.stop(signal.SIGINT) == 0, proc.log_text()[-3000:]


ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/docs", None),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_but_health_needs_the_api_key(guarded, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": KEY}):
        resp = httpx.request(method, guarded.url + path, json=body, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.json()["error"]["type"] == "Unauthorized"  # the HTTP phrase, as vLLM names it
        assert resp.headers["www-authenticate"] == "Bearer"
    resp = httpx.request(method, guarded.url + path, json=body,
                         headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code != 401


def test_health_is_open_and_the_right_key_is_served(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200
    import openai

    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_requests_past_max_queued_requests_get_503_with_retry_after(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1, "model": "alias"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}], "stream": True})):
        resp = httpx.post(guarded.url + path, json=body, headers=headers)
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        assert "max_queued_requests" in resp.json()["error"]["message"]
    # Still healthy, and answers everything else.
    assert httpx.get(guarded.url + "/health").status_code == 200
    resp = httpx.post(guarded.url + "/tokenize", json={"prompt": "x"}, headers=headers)
    assert resp.status_code == 200


def test_no_protect_metrics_leaves_metrics_open_but_not_the_api(small_engine):
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine(small_engine)
    args = argparse.Namespace(api_key=KEY, no_protect_metrics=True)
    app = build_app(engine, args)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            metrics = await c.get("/metrics")
            models = await c.get("/v1/models")
        return metrics, models

    metrics, models = asyncio.run(main())
    assert metrics.status_code == 200 and "pagedserve:kv_cache_usage_perc" in metrics.text
    assert models.status_code == 401
