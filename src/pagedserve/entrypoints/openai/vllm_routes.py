"""vLLM's extra routes and server behaviours: GET /v1/models/{id}, GET /tokenizer_info (with
--enable-tokenizer-info-endpoint), POST /invocations (SageMaker-style: a completions or chat
body), POST /v1/chat/completions/batch (a chat body whose `messages` is a list of conversations:
one choice per conversation, in order; no streaming, tools, n > 1 or beam search), GET /load (--enable-server-load-tracking), and the X-Request-Id header
(--enable-request-id-headers); CORS (`add_cors`)."""

from __future__ import annotations

import contextlib
import json
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
    from pagedserve.entrypoints.openai.api_server import respond

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

    from pagedserve.entrypoints.openai.api_server import parse_json, validation_error

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
    from pagedserve.entrypoints.openai.api_server import parse_json

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
