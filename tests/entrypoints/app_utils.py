"""The app in process (no subprocess, no port): `run_app(llm, main, **flags)` builds the server
on an `LLMEngine` with the given `pagedserve serve` flags (as attribute names) and runs
`await main(client)` with an httpx client on it."""

from __future__ import annotations

import argparse
import asyncio

import httpx

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app


def run_app(llm, main, **flags):
    engine = AsyncLLMEngine(llm)
    app = build_app(engine, argparse.Namespace(**flags))

    async def run():
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as client:
                return await main(client)
        finally:
            await engine.shutdown()

    try:
        return asyncio.run(run())
    finally:
        for request_id in list(llm.groups):
            llm.abort_request(request_id)


def events(resp: httpx.Response) -> list:
    """The JSON payloads of an SSE response body (without the final [DONE])."""
    import json

    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out
