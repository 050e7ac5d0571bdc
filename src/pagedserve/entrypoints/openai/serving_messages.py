"""Anthropic's Messages API on the chat handler (as vLLM serves it): POST /v1/messages (whole, or
streamed as Anthropic's server-sent events) and POST /v1/messages/count_tokens.

A Messages request becomes a chat completions request: `system` (a string or text blocks) the
system message; each message's blocks: ``text`` its content, an assistant's ``tool_use`` blocks
its `tool_calls`, a user's ``tool_result`` blocks `tool` messages before its text (``thinking``
blocks of earlier turns are dropped; images and documents are refused: the served models read
text); `tools` (name, description, input_schema) function tools; `tool_choice` auto / any / tool
/ none -> "auto" / "required" / the named function / "none" (``disable_parallel_tool_use`` ->
one call); `stop_sequences` -> stop; `max_tokens`, `temperature`, `top_p`, `top_k` as they are;
`thinking` enabled / disabled -> the template's ``enable_thinking`` (with --reasoning-parser the
reasoning comes back as a ``thinking`` block).

The answer's content blocks are ``thinking`` (the reasoning), ``text`` (the content) and one
``tool_use`` per call (its arguments as the `input` object); `stop_reason` is end_turn,
stop_sequence (with the sequence), max_tokens or tool_use. A stream is vLLM's event sequence:
message_start, per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, output
tokens) and message_stop; an engine failure mid-stream is an ``error`` event. Errors are
Anthropic's `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIBaseModel,
    random_id,
)
from pagedserve.entrypoints.openai.streaming import final_output
from pagedserve.entrypoints.openai.tool_calls import plan_tools

# Anthropic's error types by status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "abort": "end_turn"}


class MessagesRequest(OpenAIBaseModel):
    """POST /v1/messages (Anthropic's fields; vLLM's `chat_template_kwargs` too)."""

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(OpenAIBaseModel):
    """POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_response(e: APIError) -> Response:
    return Response(json.dumps(anthropic_error(e.status, e.message)), status_code=e.status,
                    media_type="application/json", headers=e.headers)


# --- request -> chat ----------------------------------------------------------------------------

def _text(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (400 naming `where` for anything else)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(f"{where} must be a string or a list of content blocks", 400, where)
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(f"{where}[{i}]: {kind!r} blocks are not supported here (text only)",
                           400, where)
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Messages request's `system` and `messages`."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise APIError(f"{where}.role must be 'user' or 'assistant', got {role!r}", 400,
                           "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(f"{where}.content must be a string or a list of content blocks", 400,
                           "messages")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id") or random_id("toolu")),
                              "type": "function",
                              "function": {"name": str(block.get("name", "")),
                                           "arguments": json.dumps(block.get("input") or {},
                                                                   ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                body = "" if result is None else _text(result, f"{where}.content[{j}].content")
                if block.get("is_error"):
                    body = f"Error: {body}"
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": body})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier turns' reasoning is not shown to the model again
            else:
                raise APIError(f"{where}.content[{j}]: {kind!r} blocks are not supported "
                               f"{'in ' + role + ' messages ' if kind else ''}(this server "
                               "reads text, tool_use and tool_result blocks)", 400, "messages")
        if text or calls or role == "assistant":
            message: dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise APIError(f"tools[{i}] must be an object with a name and an input_schema", 400,
                           "tools")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or
              {"type": "object", "properties": {}}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', "
                   "'name': ...}", 400, "tool_choice")


def _template_kwargs(request: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    kwargs = dict(request.chat_template_kwargs or {})
    thinking = request.thinking
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled",
                                                                "adaptive"):
        on = thinking["type"] != "disabled"
        kwargs.setdefault("enable_thinking", on)
        kwargs.setdefault("thinking", on)
    return kwargs or None


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat completions request a Messages request becomes."""
    if request.max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, got {request.max_tokens}", 400,
                       "max_tokens")
    choice, parallel = _tool_choice(request.tool_choice)
    fields = dict(model=request.model, messages=_messages(request.system, request.messages),
                  max_tokens=request.max_tokens, stop=request.stop_sequences or None,
                  temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                  tools=_tools(request.tools), tool_choice=choice,
                  parallel_tool_calls=parallel, stream=request.stream,
                  chat_template_kwargs=_template_kwargs(request))
    if request.stream:
        fields["stream_options"] = {"include_usage": True}
    # vLLM's sampling extras (repetition_penalty, seed, ...) pass through as chat fields
    extra = {k: v for k, v in (request.model_extra or {}).items()
             if k in ChatCompletionRequest.model_fields and k not in ("messages", "tools")}
    return ChatCompletionRequest.model_validate(
        {**extra, **{k: v for k, v in fields.items() if v is not None}})


# --- chat -> Messages ---------------------------------------------------------------------------

def _stop(finish_reason: str | None, stop_reason: Any, stops: list[str] | None,
          called: bool) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence); a turn that ends with tool calls (a named tool
    too, whose chat finish_reason stays "stop") is "tool_use"."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (stops or ()):
        return "stop_sequence", stop_reason
    if called and finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id() -> str:
    return "toolu_" + random_id("x")[2:26]


class OpenAIServingMessages:
    """Anthropic's Messages API on top of the chat handler (`OpenAIServingChat`)."""

    def __init__(self, chat) -> None:
        self.chat = chat

    async def create(self, request: MessagesRequest):
        """The message (a `Response`), or for `stream: true` an iterator of SSE events."""
        chat = self.chat
        creq = chat_request(request)
        prompt, params, tools, reasoning = await chat.run_cpu(chat._prepare, creq)
        message_id = "msg_" + random_id("x")[2:26]
        (stream,) = await chat.submit(message_id, [prompt], [params], prompt_param="messages",
                                      model=creq.model)
        if request.stream:
            chunks = chat._stream(creq, message_id, stream, params.n,
                                  params.output_text_buffer_length, prompt, tools, reasoning)
            return self._events(request, message_id, chunks, len(prompt.token_ids))
        try:
            final = await final_output(stream)
        except BaseException as e:
            stream.close()
            raise chat.engine_error(e, "messages") from e
        resp = chat._response(creq, message_id, final, tools, reasoning)
        choice = resp.choices[0]
        msg = choice.message
        content: list[dict[str, Any]] = []
        if msg.reasoning:
            content.append({"type": "thinking", "thinking": msg.reasoning, "signature": ""})
        if msg.content:
            content.append({"type": "text", "text": msg.content})
        for call in msg.tool_calls or ():
            content.append({"type": "tool_use", "id": _tool_use_id(),
                            "name": call.function.name,
                            "input": _input(call.function.arguments)})
        stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason,
                                           request.stop_sequences, bool(msg.tool_calls))
        body = {"id": message_id, "type": "message", "role": "assistant", "content": content,
                "model": chat.served_name(request.model), "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": resp.usage.prompt_tokens,
                          "output_tokens": resp.usage.completion_tokens}}
        return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")

    async def _events(self, request: MessagesRequest, message_id: str,
                      chunks: AsyncIterator[str], input_tokens: int) -> AsyncIterator[str]:
        """The chat stream's chunks as Anthropic's events."""

        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

        yield event("message_start", message={
            "id": message_id, "type": "message", "role": "assistant", "content": [],
            "model": self.chat.served_name(request.model), "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}})
        index, open_kind = -1, None
        finish, stop_reason, output_tokens, called = None, None, 0, False

        def close() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [event("content_block_stop", index=index)]

        def open_block(kind: str, block: dict[str, Any]) -> list[str]:
            nonlocal index, open_kind
            out = close()
            index += 1
            open_kind = kind
            return out + [event("content_block_start", index=index, content_block=block)]

        async for line in chunks:
            data = line[len("data: "):].strip() if line.startswith("data: ") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:  # the engine failed mid-stream
                for e in close():
                    yield e
                err = chunk["error"]
                yield event("error", error={"type": _ERROR_TYPES.get(err.get("code"),
                                                                       "api_error"),
                                            "message": err.get("message", "")})
                return
            if chunk.get("usage") and not chunk.get("choices"):
                output_tokens = chunk["usage"].get("completion_tokens", 0)
                continue
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                out: list[str] = []
                if delta.get("reasoning"):
                    if open_kind != "thinking":
                        out += open_block("thinking", {"type": "thinking", "thinking": "",
                                                       "signature": ""})
                    out.append(event("content_block_delta", index=index, delta={
                        "type": "thinking_delta", "thinking": delta["reasoning"]}))
                if delta.get("content"):
                    if open_kind != "text":
                        out += open_block("text", {"type": "text", "text": ""})
                    out.append(event("content_block_delta", index=index, delta={
                        "type": "text_delta", "text": delta["content"]}))
                for call in delta.get("tool_calls") or ():
                    fn = call.get("function") or {}
                    if call.get("id"):  # a new call
                        called = True
                        out += open_block("tool_use", {"type": "tool_use",
                                                       "id": _tool_use_id(),
                                                       "name": fn.get("name", ""), "input": {}})
                    if fn.get("arguments"):
                        out.append(event("content_block_delta", index=index, delta={
                            "type": "input_json_delta", "partial_json": fn["arguments"]}))
                if choice.get("finish_reason"):
                    finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
                for e in out:
                    yield e
        for e in close():
            yield e
        reason, sequence = _stop(finish, stop_reason, request.stop_sequences, called)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage={"output_tokens": output_tokens})
        yield event("message_stop")

    def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        """{"input_tokens": n}: the prompt's length as /v1/messages would render it."""
        chat = self.chat
        chat.check_model(request.model)
        creq = ChatCompletionRequest.model_validate({
            "model": request.model, "messages": _messages(request.system, request.messages)})
        _tool_choice(request.tool_choice)  # checked as /v1/messages would
        plan = plan_tools(_tools(request.tools), "none", None)  # the template sees the tools
        kwargs = _template_kwargs(request)
        if plan is not None:
            kwargs = {**(kwargs or {}), "tools": plan.tools}
        prompt = chat.render(creq.messages, chat_template=None, add_generation_prompt=True,
                             continue_final_message=False, template_kwargs=kwargs,
                             add_special_tokens=creq.add_special_tokens)
        return {"input_tokens": len(prompt.token_ids)}


def add_messages_routes(app, messages: OpenAIServingMessages, load, pool, parse_body,
                        respond) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `app` (the server's request plumbing
    passed in); their errors in Anthropic's shape."""

    @app.post("/v1/messages")
    async def create_message(raw: Request):
        with load.track() as done:
            try:
                request = await parse_body(raw, MessagesRequest, pool)
                return done(await respond(raw, messages.create(request)))
            except APIError as e:
                return error_response(e)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw: Request):
        try:
            request = await parse_body(raw, CountTokensRequest, pool)
            body = await pool.run(messages.count_tokens, request)
        except APIError as e:
            return error_response(e)
        return Response(json.dumps(body), media_type="application/json")


__all__ = ["CountTokensRequest", "MessagesRequest", "OpenAIServingMessages",
           "add_messages_routes"]
