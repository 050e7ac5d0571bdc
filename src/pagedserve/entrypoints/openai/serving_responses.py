"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API, as vLLM serves it.

A request becomes a chat request (`instructions` -> a system message, `input` -> messages,
`max_output_tokens` -> max_tokens, function tools -> chat tools, `text.format` ->
response_format), served by the chat handler: the same template, checks, tool parsers and
reasoning parser. The answer's output items are a `reasoning` item (with --reasoning-parser),
a `message` with the text after the reasoning (when there is any), and a `function_call` per
tool call. A stream sends OpenAI's events in order (response.created, response.in_progress,
per item output_item.added / content_part.added / the deltas / ...done / content_part.done /
output_item.done, then response.completed), each with its `sequence_number`.

`store`: as in vLLM, responses are kept only when the server runs with
--enable-responses-api-store (or vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1); otherwise `store:
true` (OpenAI's default) is ignored and the answer says `store: false`. Kept responses (the
newest `MAX_STORED`) can be read back with GET /v1/responses/{id} and continued with
`previous_response_id`. A response that stopped at max_output_tokens has status "incomplete"
(incomplete_details.reason "max_output_tokens"); its stream still ends with response.completed,
as vLLM's does.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedserve.engine.async_engine import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
)
from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.offload import json_response
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.reasoning import ReasoningPlan
from pagedserve.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    item_id,
)
from pagedserve.entrypoints.openai.streaming import ChoiceState, final_output
from pagedserve.entrypoints.openai.tool_calls import ToolPlan, ToolStream, parse_calls
from pagedserve.outputs import RequestOutput

MAX_STORED = 1024
# The chat handler's parameter names, as a Responses request spells them.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text", "prompt": "input"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of content parts", 400,
                       "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content: content part of type {kind!r} is not supported "
                           "(this server serves text-only models)", 400, "input")
        parts.append(part["text"])
    return "\n".join(parts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input` (a string, or a list of items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": _text_of(item.get("content"),
                                                                        where)})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again (as chat templates do)
        else:
            raise APIError(f"{where}: items must be messages (with a role), function_call or "
                           f"function_call_output, got type {kind!r}", 400, "input")
    if not messages:
        raise APIError("input must not be empty", 400, "input")
    return messages


def chat_tools(tools: list[Any] | None, tool_choice: Any) -> tuple[list[Any] | None, Any]:
    """Responses function tools (flat: name, parameters) and tool_choice, in chat's shape."""
    if not tools:
        return None, None if tool_choice in (None, "auto", "none") else tool_choice
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(f"tools[{i}]: only function tools are supported, got type {kind!r}",
                           400, "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and "function" not in tool_choice:
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return out, tool_choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"),
                                                       "schema": fmt.get("schema")}}
    return fmt


class OpenAIServingResponses:
    """The Responses API on top of the chat handler (`OpenAIServingChat`)."""

    def __init__(self, chat, enable_store: bool = False) -> None:
        self.chat = chat
        self.enable_store = enable_store or os.environ.get(
            "VLLM_ENABLE_RESPONSES_API_STORE") == "1"
        # id -> (response JSON, the conversation it answered, as chat messages)
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    # --- requests -----------------------------------------------------------------------------

    def _chat_request(self, request: ResponsesRequest) -> tuple[ChatCompletionRequest, list]:
        """The chat request a Responses request becomes, and its conversation."""
        if request.background:
            raise APIError("background responses are not supported by this server", 400,
                           "background")
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise APIError(f"max_output_tokens must be at least 1, got "
                           f"{request.max_output_tokens}", 400, "max_output_tokens")
        # The conversation (what previous_response_id continues); the instructions are not
        # part of it (OpenAI: they are not carried over to the next response).
        conversation: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            kept = self.stored.get(request.previous_response_id)
            if kept is None:
                raise APIError(f"Response with id '{request.previous_response_id}' not found.",
                               404, "previous_response_id")
            conversation += kept[1] + _assistant_messages(kept[0])
        conversation += input_messages(request.input)
        messages = ([{"role": "system", "content": request.instructions}]
                    if request.instructions else []) + conversation
        tools, tool_choice = chat_tools(request.tools, request.tool_choice)
        extra = {k: v for k, v in (request.model_extra or {}).items()
                 if k in ChatCompletionRequest.model_fields}
        fields = dict(model=request.model, messages=messages, max_tokens=request.max_output_tokens,
                      temperature=request.temperature, top_p=request.top_p, tools=tools,
                      tool_choice=tool_choice, parallel_tool_calls=request.parallel_tool_calls,
                      response_format=response_format(request.text), user=request.user)
        chat_request = ChatCompletionRequest.model_validate({**extra, **fields})
        if chat_request.n not in (None, 1) or chat_request.best_of not in (None, 1):
            raise APIError("a response has one output: n and best_of must be 1", 400, "n")
        leftover = [k for k in (request.model_extra or {}) if k not in extra]
        if leftover:
            chat_request.__pydantic_extra__ = {k: request.model_extra[k] for k in leftover}
        return chat_request, conversation

    def _prepare(self, request: ResponsesRequest):
        chat_request, conversation = self._chat_request(request)
        try:
            return (*self.chat._prepare(chat_request), conversation)
        except APIError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise

    async def create(self, request: ResponsesRequest):
        """The response (as a `Response`), or for `stream: true` an iterator of SSE events."""
        prompt, params, tools, reasoning, conversation = await self.chat.run_cpu(
            self._prepare, request)
        response_id = item_id("resp")
        try:
            (stream,) = await self.chat.submit(response_id, [prompt], [params],
                                               prompt_param="input", model=request.model)
        except APIError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise
        if request.stream:
            return self._stream(request, response_id, stream, params.output_text_buffer_length,
                                tools, reasoning, conversation)
        try:
            final = await final_output(stream)
        except BaseException as e:
            stream.close()
            raise self.chat.engine_error(e, "input") from e
        body = self._build(request, response_id, final, tools, reasoning)
        self._keep(request, body, conversation)
        return json_response(body)

    def cancel(self, response_id: str):
        """vLLM's POST /v1/responses/{id}/cancel: only a background response still queued or in
        progress can be cancelled; this server runs none (`background` is refused), so a kept
        response is a 400 ("Cannot cancel a synchronous response.", as vLLM answers for one) and
        an unknown id a 404."""
        if response_id not in self.stored:
            raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        raise APIError("Cannot cancel a synchronous response.", 400, "response_id")

    def retrieve(self, response_id: str):
        kept = self.stored.get(response_id)
        if kept is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        return kept[0]

    def _keep(self, request: ResponsesRequest, body: ResponseObject,
              conversation: list[dict[str, Any]]) -> None:
        if not body.store:
            return
        self.stored[body.id] = (body.model_dump(mode="json"), conversation)
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)

    # --- answers ------------------------------------------------------------------------------

    def _base(self, request: ResponsesRequest, response_id: str, **kw) -> ResponseObject:
        return ResponseObject(
            id=response_id, model=self.chat.model_name, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, temperature=request.temperature,
            top_p=request.top_p, tools=request.tools or [],
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=request.text or {"format": {"type": "text"}},
            store=bool(request.store) and self.enable_store,
            previous_response_id=request.previous_response_id, metadata=request.metadata,
            user=request.user, truncation=request.truncation or "disabled",
            reasoning=request.reasoning, **kw)

    def _build(self, request: ResponsesRequest, response_id: str, out: RequestOutput,
               tools: ToolPlan | None, plan: ReasoningPlan | None,
               ids: dict[str, str] | None = None, **kw) -> ResponseObject:
        """The finished response; `ids`: the item ids a stream already announced (`kw`: more
        fields, e.g. its `created_at`)."""
        ids = ids or {}
        comp = out.outputs[0]
        reasoning, text = plan.split(comp.text) if plan else (None, comp.text)
        # NOTE: tools are read from the text after the reasoning.
        content, calls = parse_calls(tools, text or "") if tools else (text, [])
        items: list[Any] = []
        if reasoning is not None and plan.include:
            items.append(ReasoningItem(id=ids.get("reasoning") or item_id("rs"),
                                       content=[ReasoningText(text=reasoning)]))
        if content:
            items.append(MessageItem(id=ids.get("message") or item_id("msg"),
                                     content=[OutputText(text=content)]))
        items += [FunctionCallItem(name=n, arguments=a) for n, a in calls]
        incomplete = comp.finish_reason == "length"
        usage = ResponseUsage(
            input_tokens=len(out.prompt_token_ids), output_tokens=len(comp.token_ids),
            total_tokens=len(out.prompt_token_ids) + len(comp.token_ids),
            input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens or 0),
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=plan.reasoning_tokens(comp.token_ids, reasoning) if plan else 0))
        return self._base(request, response_id, output=items, usage=usage,
                          status="incomplete" if incomplete else "completed",
                          incomplete_details=IncompleteDetails(reason="max_output_tokens")
                          if incomplete else None, **kw)

    async def _stream(self, request: ResponsesRequest, response_id: str, stream, holdback: int,
                      tools: ToolPlan | None, plan: ReasoningPlan | None,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(kind: str, **fields) -> str:
            data = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        start = self._base(request, response_id, status="in_progress").model_dump(mode="json")
        created = {"created_at": start["created_at"]}
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        state = ChoiceState(holdback)
        splitter = plan.stream() if plan else None
        tool_stream = ToolStream(tools) if tools else None
        ids: dict[str, str] = {}
        texts = {"reasoning": "", "message": ""}
        current: list[str] = []  # the open item's kind (at most one)
        index = -1

        def open_item(kind: str) -> list[str]:
            nonlocal index
            index += 1
            current.append(kind)
            ids[kind] = item_id("rs" if kind == "reasoning" else "msg")
            item = (ReasoningItem(id=ids[kind], status="in_progress") if kind == "reasoning"
                    else MessageItem(id=ids[kind], status="in_progress"))
            part = (ReasoningText(text="") if kind == "reasoning" else OutputText(text=""))
            return [event("response.output_item.added", output_index=index,
                          item=item.model_dump(mode="json")),
                    event("response.content_part.added", output_index=index, content_index=0,
                          item_id=ids[kind], part=part.model_dump(mode="json"))]

        def close_item() -> list[str]:
            kind = current.pop()
            text = texts[kind]
            if kind == "reasoning":
                part = ReasoningText(text=text)
                item = ReasoningItem(id=ids[kind], content=[part])
                done = event("response.reasoning_text.done", output_index=index,
                             content_index=0, item_id=ids[kind], text=text)
            else:
                part = OutputText(text=text)
                item = MessageItem(id=ids[kind], content=[part])
                done = event("response.output_text.done", output_index=index, content_index=0,
                             item_id=ids[kind], text=text, logprobs=[])
            return [done, event("response.content_part.done", output_index=index,
                                content_index=0, item_id=ids[kind],
                                part=part.model_dump(mode="json")),
                    event("response.output_item.done", output_index=index,
                          item=item.model_dump(mode="json"))]

        def deltas(kind: str, delta: str) -> list[str]:
            out = []
            if current and current[-1] != kind:
                out += close_item()
            if not current:
                out += open_item(kind)
            texts[kind] += delta
            name = ("response.reasoning_text.delta" if kind == "reasoning"
                    else "response.output_text.delta")
            extra = {} if kind == "reasoning" else {"logprobs": []}
            out.append(event(name, output_index=index, content_index=0, item_id=ids[kind],
                             delta=delta, **extra))
            return out

        last: RequestOutput | None = None
        try:
            try:
                async for out in stream:
                    last = out
                    comp = out.outputs[0]
                    finished = comp.finish_reason is not None
                    text = state.next_text(comp.text, finished)
                    thought = ""
                    if splitter:
                        thought, text = splitter.feed(text, finished)
                        thought = thought if plan.include else ""
                    if tool_stream:
                        text, _ = tool_stream.feed(text, finished)  # calls: from the final text
                    for kind, delta in (("reasoning", thought), ("message", text)):
                        if delta:
                            for line in deltas(kind, delta):
                                yield line
            finally:
                stream.close()
            if current:
                for line in close_item():
                    yield line
            if last is None or not last.finished:
                raise EngineShutdownError("the response ended without a final output")
            body = self._build(request, response_id, last, tools, plan, ids, **created)
            for item in body.output:
                if not isinstance(item, FunctionCallItem):
                    continue
                index += 1
                added = item.model_copy(update={"arguments": "", "status": "in_progress"})
                yield event("response.output_item.added", output_index=index,
                            item=added.model_dump(mode="json"))
                yield event("response.function_call_arguments.delta", output_index=index,
                            item_id=item.id, delta=item.arguments)
                yield event("response.function_call_arguments.done", output_index=index,
                            item_id=item.id, arguments=item.arguments)
                yield event("response.output_item.done", output_index=index,
                            item=item.model_dump(mode="json"))
            self._keep(request, body, conversation)
            yield event("response.completed", response=body.model_dump(mode="json"))
        except (EngineDeadError, EngineShutdownError, EngineStepError) as e:
            code = 500 if isinstance(e, EngineStepError) else 503
            yield event("error", code=str(code), message=str(e), param=None)


def add_responses_routes(app, responses: OpenAIServingResponses, load, pool, parse_body,
                         respond) -> None:
    """POST /v1/responses, GET /v1/responses/{response_id} and POST .../cancel on `app` (the
    server's request plumbing passed in: `parse_body`, `respond`, its load tracker and CPU
    pool)."""
    @app.post("/v1/responses")
    async def create_response(raw: Request):
        with load.track() as done:
            request = await parse_body(raw, ResponsesRequest, pool)
            return done(await respond(raw, responses.create(request)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return Response(json.dumps(responses.retrieve(response_id)),
                        media_type="application/json")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return Response(json.dumps(responses.cancel(response_id)),
                        media_type="application/json")


def _assistant_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output as chat messages (for `previous_response_id`)."""
    out: list[dict[str, Any]] = []
    for item in body.get("output", []):
        if item["type"] == "message":
            out.append({"role": "assistant",
                        "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}]})
    return out
