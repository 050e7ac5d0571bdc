"""vLLM's extra routes and server behaviours: GET /v1/models/{id}, GET /tokenizer_info (with
--enable-tokenizer-info-endpoint), POST /invocations (SageMaker-style: a completions or chat
body), POST /v1/chat/completions/batch (a chat body whose `messages` is a list of conversations:
one choice per conversation, in order; no streaming, tools, n > 1 or beam search), GET /load
(--enable-server-load-tracking), and the X-Request-Id header (--enable-request-id-headers);
CORS (`add_cors`); the operations routes (`add_operations_routes`: abort, and behind
VLLM_SERVER_DEV_MODE sleep / wake_up / pause / RPC / server info, behind --profiler-config the
profiler), each behind the switch vLLM 0.32 puts it behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.offload import CPUPool, json_response
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    OpenAIBaseModel,
)
from pagedserve.entrypoints.openai.request_io import parse_json, respond, validation_error

logger = logging.getLogger("pagedserve.server")


class LoadTracker:
    """`app.state.server_load_metrics`: completions / chat requests in progress (a stream counts
    until its last byte is sent), with --enable-server-load-tracking; GET /load reads it."""

    def __init__(self, app: FastAPI, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled
        app.state.server_load_metrics = 0

    def _add(self, delta: int) -> None:
        self.app.state.server_load_metrics += delta

    @contextlib.contextmanager
    def track(self):
        """Count a request from here until the response `done(response)` was given is sent
        (or the block raises)."""
        if not self.enabled:
            yield lambda response: response
            return
        self._add(1)
        handed_over = False

        def done(response: Response) -> Response:
            nonlocal handed_over
            if isinstance(response, StreamingResponse):
                handed_over = True
                response.body_iterator = self._counted(response.body_iterator)
            return response

        try:
            yield done
        finally:
            if not handed_over:
                self._add(-1)

    async def _counted(self, body):
        try:
            async for part in body:
                yield part
        finally:
            self._add(-1)


def add_cors(app: FastAPI, args) -> None:
    """FastAPI's CORSMiddleware with vLLM 0.32's flags and defaults (--allowed-origins: none, so
    no cross-origin browser access unless configured; --allowed-methods, --allowed-headers:
    every one; --allow-credentials: off)."""
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(getattr(args, "allowed_origins", None) or []),
        allow_methods=getattr(args, "allowed_methods", None) or ["*"],
        allow_headers=getattr(args, "allowed_headers", None) or ["*"],
        allow_credentials=bool(getattr(args, "allow_credentials", False)),
    )


class RequestIdMiddleware:
    """Pure ASGI: every response carries `X-Request-Id`: the request's own, else a new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"),
                          None) or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's init configuration (JSON-able values; added
    tokens as their text), its class, special tokens and chat template."""
    info: dict[str, Any] = {}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if key in ("vocab_file", "merges_file", "tokenizer_file"):  # paths (vLLM drops them)
            continue
        value = getattr(value, "content", value)  # AddedToken -> its text
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        info[key] = value
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = chat_template or getattr(tokenizer, "chat_template", None)
    return info


def add_vllm_routes(app: FastAPI, engine, settings, completions, chat, pool: CPUPool, *,
                    tokenizer_info_endpoint: bool = False) -> None:
    """Register the routes of the module docstring on `app`."""
    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id not in settings.served_model_names:
            raise APIError(f"The model `{model_id}` does not exist.", 404, "model")
        llm = engine.engine
        return json_response(ModelCard(id=model_id, root=llm.source.name,
                                       max_model_len=llm.max_model_len))

    @app.get("/load")
    async def get_load():
        return Response(json.dumps({"server_load": app.state.server_load_metrics}),
                        media_type="application/json")

    if tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            template = chat.chat_format.template
            body = await pool.run(tokenizer_info, engine.tokenizer, template)
            return Response(json.dumps(body), media_type="application/json")

    @app.post("/invocations")
    async def invocations(raw: Request):
        """SageMaker-style: a chat body (with `messages`) or a completions body (`prompt`)."""
        request = await pool.run(_invocation_request, await raw.body())
        handler = chat if isinstance(request, ChatCompletionRequest) else completions
        return await respond(raw, handler.create(request))

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(raw: Request):
        requests = await pool.run(batch_chat_requests, await raw.body())
        return await respond(raw, chat.create_batch(requests))


class _BatchBody(OpenAIBaseModel):
    messages: list[list[Any]]  # conversations (each validated as a chat request's messages)


# vLLM's BatchChatCompletionRequest refuses these (field -> what it allows)
_BATCH_LIMITS = {
    "stream": (lambda v: not v, "Batch chat completions do not support streaming"),
    "n": (lambda v: v in (None, 1), "Batch chat completions do not support `n > 1`"),
    "use_beam_search": (lambda v: not v, "Batch chat completions do not support beam search"),
    "tools": (lambda v: not v, "Batch chat completions do not support tools"),
    "tool_choice": (lambda v: v in (None, "none"),
                    "Batch chat completions support only tool_choice \"none\""),
}


def batch_chat_requests(body: bytes) -> list[ChatCompletionRequest]:
    """The chat request of each conversation of a /v1/chat/completions/batch body (every other
    field shared); APIError 400 naming the field otherwise."""
    from pydantic import ValidationError

    batch = parse_json(body, _BatchBody)
    if not batch.messages or not all(batch.messages):
        raise APIError("messages must be a non-empty list of non-empty conversations (lists "
                       "of messages)", 400, "messages")
    shared = dict(batch.model_extra or {})
    for name, (ok, message) in _BATCH_LIMITS.items():
        if name in shared and not ok(shared[name]):
            raise APIError(message, 400, name)
    try:
        return [ChatCompletionRequest.model_validate({**shared, "messages": conversation})
                for conversation in batch.messages]
    except ValidationError as e:
        raise validation_error(e.errors()) from e


def _invocation_request(body: bytes) -> ChatCompletionRequest | CompletionRequest:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and "messages" in data:
        return parse_json(body, ChatCompletionRequest)
    if isinstance(data, dict) and "prompt" in data:
        return parse_json(body, CompletionRequest)
    raise APIError("/invocations takes a chat completions body (with messages) or a "
                   "completions body (with prompt)", 400)


# --- operations (vLLM's serve/dev, rl and profile routers) --------------------------------------

def dev_mode() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: the development routes (sleep, RPC, pause, ...) are served."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")


def profiler_config(args) -> dict[str, Any] | None:
    """`--profiler-config` (vLLM's ProfilerConfig: a dict or its JSON text) when it names a
    profiler, else None (the profile routes are then not served, as in vLLM)."""
    value = getattr(args, "profiler_config", None)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"profiler_config: not a JSON object: {value!r}") from None
    if value is not None and not isinstance(value, dict):
        value = {k: getattr(value, k) for k in ("profiler", "torch_profiler_dir")
                 if hasattr(value, k)}
    if not value or not value.get("profiler"):
        return None
    if value["profiler"] != "torch":
        raise ValueError(f"profiler_config.profiler: only 'torch' profiles on this server, got "
                         f"{value['profiler']!r}")
    return value


async def _json_object(raw: Request) -> dict[str, Any]:
    body = await raw.body()
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(f"Invalid JSON in the request body: {e}", 400) from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", 400)
    return data


def _ok(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body, default=str), media_type="application/json")


def add_operations_routes(app: FastAPI, engine, args) -> None:
    """vLLM's operations routes, behind the same switches as in vLLM 0.32:

    - always: POST /inference/v1/abort_requests (``{"request_ids": [...]}``; each request ends
      with finish_reason "abort", its blocks freed);
    - with VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache (``{"success": bool}``), /sleep
      (``?level=1``: the KV cache freed; refused while requests run), /wake_up (``?tags=``),
      GET /is_sleeping, POST /collective_rpc (``{"method", "args", "kwargs"}``: a worker
      method on every rank), GET /server_info (the engine's options, the VLLM_ / PAGEDSERVE_
      environment, the system), POST /pause (``?mode=abort|wait|keep``), /resume, GET
      /is_paused, POST /abort_requests (no ids: every request);
    - with --profiler-config naming the torch profiler: POST /start_profile, /stop_profile
      (a Chrome trace in its torch_profiler_dir).
    """
    from pagedserve.engine.llm_extras import LLMExtras

    class EngineOps(LLMExtras):
        """`LLM`'s sleep / wake_up / collective_rpc on the server's engine (run on its
        thread)."""

        def __init__(self, llm_engine) -> None:
            self.engine = llm_engine

    ops = EngineOps(engine.engine)

    async def abort_ids(ids) -> dict[str, Any]:
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, str) for i in ids)):
            raise APIError("request_ids must be a list of request ids", 400, "request_ids")
        aborted = await engine.abort_requests(ids)
        return {"status": "aborted", "aborted": len(aborted), "request_ids": aborted}

    @app.post("/inference/v1/abort_requests")
    async def abort_requests_inference(raw: Request):
        body = await _json_object(raw)
        if body.get("request_ids") is None:
            raise APIError("Missing 'request_ids' in request body", 400, "request_ids")
        return _ok(await abort_ids(body["request_ids"]))

    profile = profiler_config(args)
    if profile is not None:
        add_profile_routes(app, engine, profile)

    if not dev_mode():
        return
    logger.warning("SECURITY WARNING: development endpoints are enabled (VLLM_SERVER_DEV_MODE)! "
                   "This should NOT be used in production!")

    async def in_engine(fn):
        try:
            return await engine.call_in_engine_thread(fn)
        except ValueError as e:
            raise APIError(str(e), 400) from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return _ok({"success": bool(await in_engine(lambda e: ops.reset_prefix_cache()))})

    @app.post("/sleep")
    async def sleep(level: int = 1):
        await in_engine(lambda e: ops.sleep(level))
        return _ok({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        tags = raw.query_params.getlist("tags") or None

        def wake(e):
            ops.wake_up(tags)
            # NOTE: the rebuilt scheduler and block manager count preemptions and prefix hits
            # from 0 again: the metrics' previous totals start from there too (no negative
            # increments).
            engine._prev_totals = engine._engine_totals()
            return not e.sleeping

        awake = await in_engine(wake)
        return _ok({"status": "awake" if awake else "sleeping", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return _ok({"is_sleeping": bool(engine.engine.sleeping)})

    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request):
        body = await _json_object(raw)
        method = body.get("method")
        if not isinstance(method, str):
            raise APIError("Missing 'method' in request body", 400, "method")
        args_ = body.get("args") or []
        kwargs = body.get("kwargs") or {}
        if not isinstance(args_, list) or not isinstance(kwargs, dict):
            raise APIError("args must be a list and kwargs an object", 400, "args")
        results = await in_engine(lambda e: ops.collective_rpc(
            method, timeout=body.get("timeout"), args=tuple(args_), kwargs=kwargs))
        return _ok({"results": results})

    @app.get("/server_info")
    async def server_info(config_format: str = "text"):
        if config_format not in ("text", "json"):
            raise APIError("config_format must be 'text' or 'json'", 400, "config_format")
        import dataclasses

        from pagedserve.entrypoints.collect_env import collect

        options = dataclasses.asdict(engine.engine.args)
        env = {k: v for k, v in os.environ.items()
               if k.startswith(("VLLM_", "PAGEDSERVE_")) and "KEY" not in k}
        system = await asyncio.to_thread(collect)
        return _ok({"vllm_config": options if config_format == "json" else str(options),
                    "vllm_env": env,
                    "system_env": {title: dict(rows) for title, rows in system}})

    @app.post("/pause")
    async def pause(mode: str = "abort"):
        if mode not in ("abort", "wait", "keep"):
            raise APIError("mode must be 'abort', 'wait' or 'keep'", 400, "mode")
        if mode == "abort":
            await engine.abort_requests(None)
        elif mode == "wait":
            while engine.num_in_flight:
                await asyncio.sleep(0.01)
        await engine.pause()
        return _ok({"status": "paused"})

    @app.post("/resume")
    async def resume():
        await engine.resume()
        return _ok({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return _ok({"is_paused": engine.paused})

    @app.post("/abort_requests")
    async def abort_requests(raw: Request):
        body = await _json_object(raw)
        return _ok(await abort_ids(body.get("request_ids") or None))


def add_profile_routes(app: FastAPI, engine, config: dict[str, Any]) -> None:
    """POST /start_profile and /stop_profile: torch's profiler around the engine's steps, its
    Chrome trace written to the config's torch_profiler_dir at the stop."""
    from pathlib import Path

    folder = Path(config.get("torch_profiler_dir") or ".")
    state: dict[str, Any] = {}
    logger.warning("Profiler with mode 'torch' is enabled in the API server. This should ONLY "
                   "be used for local development!")

    @app.post("/start_profile")
    async def start_profile():
        if "profiler" in state:
            raise APIError("the profiler is already running", 400)
        import torch

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          record_shapes=False)
        await engine.call_in_engine_thread(lambda e: profiler.__enter__())
        state["profiler"] = profiler
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile():
        profiler = state.pop("profiler", None)
        if profiler is None:
            raise APIError("the profiler is not running (POST /start_profile first)", 400)
        await engine.call_in_engine_thread(lambda e: profiler.__exit__(None, None, None))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"pagedserve-trace-{int(time.time() * 1000)}.json"
        await asyncio.to_thread(profiler.export_chrome_trace, str(path))
        logger.info("profile written to %s", path)
        return Response(status_code=200)
