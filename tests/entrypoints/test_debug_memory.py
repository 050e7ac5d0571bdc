"""The memory debug endpoints (`--enable-debug-endpoints`) that scripts/soak.py reads:
GET /debug/memory, POST /debug/memory/trim, POST /debug/tracemalloc/start and
GET /debug/tracemalloc/snapshot; in-process on the tiny model."""

import argparse
import asyncio
import sys

import httpx
import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.timeout(120)


def run_app(engine, calls):
    """Start `engine`, run `calls(client)` against the app with debug endpoints, stop."""
    app = build_app(engine, argparse.Namespace(enable_debug_endpoints=True))

    async def main():
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as c:
                return await calls(c)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_memory_trim_and_tracemalloc_endpoints(small_engine):
    async def calls(c):
        out = {"memory": await c.get("/debug/memory", params={"objects": 5})}
        out["no_trace"] = await c.get("/debug/tracemalloc/snapshot")
        out["bad_frames"] = await c.post("/debug/tracemalloc/start", params={"frames": 0})
        out["start"] = await c.post("/debug/tracemalloc/start", params={"frames": 2})
        out["completion"] = await c.post("/v1/completions",
                                         json={"prompt": "The", "max_tokens": 3})
        out["snapshot"] = await c.get("/debug/tracemalloc/snapshot",
                                      params={"top": 3, "stop": True})
        out["stopped"] = await c.get("/debug/tracemalloc/snapshot")
        out["trim"] = await c.post("/debug/memory/trim")
        return out

    out = run_app(AsyncLLMEngine(small_engine), calls)
    memory = out["memory"].json()
    assert out["memory"].status_code == 200
    assert memory["rss"] > 0 and set(memory["smaps"]) == {"heap", "kv", "weights", "anon",
                                                          "file", "stack", "other"}
    # The mappings add up to about the RSS of the same moment.
    assert abs(sum(memory["smaps"].values()) - memory["rss"]) < 0.1 * memory["rss"]
    assert 0 < len(memory["objects"]) <= 5 and all(n > 0 for n in memory["objects"].values())
    if sys.platform == "linux" and memory["malloc"]:  # glibc
        m = memory["malloc"]
        assert m["in_use"] > 0 and m["arenas"] and m["arenas"][0]["nr"] == 0
    assert out["completion"].status_code == 200
    for name in ("no_trace", "bad_frames", "stopped"):
        assert out[name].status_code == 400, out[name].text
        assert set(out[name].json()["error"]) == {"message", "type", "param", "code"}
    assert out["start"].json() == {"started": True, "frames": 2}
    snap = out["snapshot"].json()
    assert out["snapshot"].status_code == 200 and snap["traced"] > 0
    assert len(snap["top"]) <= 3 and all(len(s["traceback"]) <= 2 for s in snap["top"])
    trim = out["trim"].json()
    assert trim["rss_before"] > 0 and trim["rss_after"] > 0


def test_memory_endpoints_are_absent_unless_enabled(http):
    for method, path in (("GET", "/debug/memory"), ("POST", "/debug/memory/trim"),
                         ("POST", "/debug/tracemalloc/start"),
                         ("GET", "/debug/tracemalloc/snapshot")):
        assert http.request(method, path).status_code == 404, path
