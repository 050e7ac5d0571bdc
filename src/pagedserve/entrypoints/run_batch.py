"""`pagedserve run-batch`: an OpenAI batch file run offline, as vLLM's `vllm run-batch`.

The input is OpenAI's batch format, one JSON request a line:
`{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}` (urls
/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score, /v1/rerank). Every request goes
through the OpenAI server's own handlers, in process (the app of `api_server.build_app` over an
ASGI transport, no socket), all at once so that the engine batches them; each answer is one
output line, in input order: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}` (a request the server refuses keeps its status and error body; a line that is
not such a request gets `error` and no response).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True,
                   help="the batch file, OpenAI's format (one request a line; - for stdin)")
    p.add_argument("-o", "--output-file", required=True,
                   help="where the answers go, one a line in input order (- for stdout)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the requests may use (default: the model's name)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="the most requests in flight at once (default: all)")
    from pagedserve.entrypoints.openai.cli_args import add_openai_server_args

    add_openai_server_args(p)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineArgs
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import build_app

    lines = _read_lines(args.input_file)
    engine = AsyncLLMEngine(LLMEngine(EngineArgs.from_namespace(args)), log_stats_interval=None)
    app = build_app(engine, args)
    results = asyncio.run(_run(app, engine, lines, args.max_concurrency))
    text = "".join(json.dumps(r) + "\n" for r in results)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    failed = sum(1 for r in results if r["error"] is not None or r["response"]["status_code"] >= 400)
    print(f"run-batch: {len(results)} requests, {failed} failed", file=sys.stderr)
    return 0


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return [line for line in sys.stdin.read().splitlines() if line.strip()]
    try:
        with open(path, encoding="utf-8") as f:
            return [line for line in f.read().splitlines() if line.strip()]
    except OSError as e:
        raise ValueError(f"--input-file {path}: {e}") from e


async def _run(app, engine, lines: list[str], max_concurrency: int | None) -> list[dict]:
    import httpx

    engine.start()
    limit = asyncio.Semaphore(max_concurrency or max(1, len(lines)))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                     timeout=None) as client:
            return list(await asyncio.gather(*(_one(client, line, limit) for line in lines)))
    finally:
        await engine.shutdown()


async def _one(client, line: str, limit: asyncio.Semaphore) -> dict[str, Any]:
    result: dict[str, Any] = {"id": f"batch-{uuid.uuid4().hex}", "custom_id": None,
                              "response": None, "error": None}
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a batch line must be a JSON object")
        result["custom_id"] = request.get("custom_id")
        url, method = request.get("url"), str(request.get("method", "POST")).upper()
        if url not in URLS or method != "POST":
            raise ValueError(f"unsupported request {method} {url!r}: POST to one of {URLS}")
        if not isinstance(request.get("body"), dict):
            raise ValueError("the request's body must be a JSON object")
        body = {**request["body"], "stream": False}
    except ValueError as e:
        result["error"] = {"message": str(e), "type": "invalid_batch_line"}
        return result
    async with limit:
        resp = await client.post(url, json=body)
    request_id = f"batch-{uuid.uuid4().hex}"
    result["response"] = {"status_code": resp.status_code, "request_id": request_id,
                          "body": resp.json()}
    return result
