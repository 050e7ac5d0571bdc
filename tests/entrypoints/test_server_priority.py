"""The server's `priority` field: taken under --scheduling-policy priority, a 400 naming
--scheduling-policy (param "priority") under fcfs, on completions and chat."""

import argparse
import asyncio

import httpx
import pytest

from pagedserve import LLM
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app


def _llm(path, **kw):
    return LLM(path, dtype="float32", block_size=4, num_kv_blocks=12, max_num_seqs=1, **kw)


@pytest.mark.timeout(120)
def test_server_takes_priority_under_the_priority_policy_and_400s_it_under_fcfs(checkpoints):
    path = str(checkpoints("llama"))

    def post(llm, bodies):
        engine = AsyncLLMEngine(llm.engine)
        app = build_app(engine, argparse.Namespace())

        async def main():
            engine.start()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=60) as c:
                out = [await c.post(url, json=body) for url, body in bodies]
            await engine.shutdown()
            return out

        return asyncio.run(main())

    body = {"prompt": [1, 5, 9], "max_tokens": 2, "priority": 3}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
    bad, bad_chat, ok = post(_llm(path), [("/v1/completions", body),
                                          ("/v1/chat/completions", chat),
                                          ("/v1/completions", {**body, "priority": 0})])
    for resp in (bad, bad_chat):
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert "--scheduling-policy" in err["message"] and err["param"] == "priority"
    assert ok.status_code == 200
    good, good_chat = post(_llm(path, scheduling_policy="priority"),
                           [("/v1/completions", body), ("/v1/chat/completions", chat)])
    assert good.status_code == 200 and good_chat.status_code == 200
