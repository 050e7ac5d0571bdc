"""The server's request and response plumbing, shared by its routes (api_server.py and the
route modules it mounts: serving_pooling.py, vllm_routes.py, ...): a JSON body parsed and
validated into a pydantic model (400, not 422, naming the field), and a handler run until it
finishes or the client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.offload import CPUPool, json_response

T = TypeVar("T", bound=BaseModel)

# Bodies larger than this are parsed on the CPU pool rather than on the event loop.
_PARSE_INLINE_BYTES = 64 * 1024


async def parse_body(raw: Request, model: type[T], pool: CPUPool | None = None) -> T:
    """The JSON body validated as `model`; 400 (not 422) naming the field otherwise. A large
    body is parsed on `pool` (off the event loop)."""
    body = await raw.body()
    if pool is not None and len(body) > _PARSE_INLINE_BYTES:
        return await pool.run(parse_json, body, model)
    return parse_json(body, model)


def parse_json(body: bytes, model: type[T]) -> T:
    """`parse_body`'s work: JSON (finite numbers only), then pydantic validation."""
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as e:
        raise APIError("Invalid JSON in the request body: nested too deeply", 400) from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, too many digits
        raise APIError(f"Invalid JSON in the request body: {e}", 400) from e
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from e
    except RecursionError as e:
        raise APIError("The request body is nested too deeply", 400) from e


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    if not errors:
        return APIError("invalid request", 400)
    loc = [str(part) for part in errors[0].get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    messages = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        messages.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return APIError("; ".join(messages), 400, param)


async def respond(raw: Request, handler) -> Response:
    """Run a handler (its result: a response model, or an SSE iterator for streams) until it
    finishes or the client disconnects; a disconnect cancels it, aborting its requests."""
    result = await run_until_disconnect(raw, handler)
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return json_response(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def run_until_disconnect(raw: Request, coro) -> Any:
    """`await coro`, cancelled if the client disconnects first (then None).

    NOTE: the body must have been read: after it, the ASGI `receive` only ever returns
    `http.disconnect`.
    """
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        watcher.cancel()
        raise
    if handler.done():
        watcher.cancel()
        return handler.result()
    handler.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await handler
    return None


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
