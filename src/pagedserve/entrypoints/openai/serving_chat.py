"""POST /v1/chat/completions: messages rendered with the chat template, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.engine.async_engine import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
)
from pagedserve.entrypoints.openai.chat_template import flatten_content, render_chat
from pagedserve.entrypoints.openai.errors import APIError, error_body
from pagedserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from pagedserve.entrypoints.openai.streaming import DONE, ChoiceState, final_output, sse
from pagedserve.entrypoints.openai.tool_calls import (
    ToolPlan,
    ToolStream,
    finish_reason,
    parse_calls,
    plan_tools,
    tool_calls_json,
)
from pagedserve.entrypoints.openai.tool_parsers import make_tool_parser
from pagedserve.outputs import RequestOutput

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    """Chat completions: one engine request per call, `n` choices."""

    request_fields = frozenset(ChatCompletionRequest.model_fields)

    def __init__(self, engine, settings) -> None:
        super().__init__(engine, settings)
        parser = settings.tool_call_parser
        self.tool_parser = make_tool_parser(parser) if parser else None

    def render(self, messages: list[ChatMessage], *, chat_template: str | None,
               add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: dict[str, Any] | None, add_special_tokens: bool) -> Prompt:
        """The prompt for a conversation (also used by /tokenize). ValueError -> 400."""
        try:
            dicts = []
            for i, m in enumerate(messages):
                d = m.model_dump(exclude_none=True)
                d["content"] = flatten_content(m.content, i)
                dicts.append(d)
            text = render_chat(
                self.tokenizer, dicts, self.chat_format, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, template_kwargs=template_kwargs,
            )
        except ValueError as e:
            param = "chat_template" if chat_template and "template" in str(e) else "messages"
            raise APIError(str(e), 400, param) from e
        ids = self.tokenize(text, add_special_tokens)
        self.check_token_ids(ids, "messages")
        return Prompt(ids, text)

    async def create(self, request: ChatCompletionRequest
                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or for `stream: true` an iterator of SSE lines."""
        self.check_model(request.model)
        self.check_fields(request)
        if request.echo:
            raise APIError("echo is not supported for chat completions by this server", 400,
                           "echo")
        top = request.top_logprobs
        if top is not None and top < 0:
            raise APIError(f"top_logprobs must be >= 0, got {top}", 400, "top_logprobs")
        if top and not request.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        max_tokens, max_param = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_param = request.max_tokens, "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"{max_param} must be at least 1, got {max_tokens}", 400, max_param)
        tools, structured = self._tools(request)
        prompt = self.render(
            request.messages, chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=({**(request.chat_template_kwargs or {}), "tools": tools.tools}
                             if tools else request.chat_template_kwargs),
            add_special_tokens=request.add_special_tokens,
        )
        params = self.sampling_params(
            request, max_tokens=max_tokens,
            logprobs=(top or 0) if request.logprobs else None, logprobs_param="top_logprobs",
            extra_stop_token_ids=self.chat_format.stop_token_ids, structured_outputs=structured,
        )
        params = self.for_prompt(params, len(prompt.token_ids), prompt_param="messages",
                                 max_tokens_param=max_param)
        if tools is not None and not tools.makes_calls:  # "none": the template has seen them
            tools = None
        request_id = random_id("chatcmpl")
        (stream,) = await self.submit(request_id, [prompt], [params], prompt_param="messages")
        if request.stream:
            return self._stream(request, request_id, stream, params.n,
                                params.output_text_buffer_length, tools)
        try:
            final = await final_output(stream)
        except BaseException as e:
            stream.close()
            raise self.engine_error(e, "messages") from e
        return self._response(request, request_id, final, tools)

    def _tools(self, request: ChatCompletionRequest):
        """The request's tool plan (None without tools) and its structured-output constraint:
        the one `required` / a named function enforces, else the request's own."""
        plan = plan_tools(request.tools, request.tool_choice, self.tool_parser)
        structured = self.structured_outputs(request)
        if plan is not None and plan.constraint is not None:
            if structured is not None:
                raise APIError(f"tool_choice {request.tool_choice!r} cannot be combined with "
                               "another structured-output constraint", 400, "tool_choice")
            structured = plan.constraint
        return plan, structured

    def _logprobs(self, request: ChatCompletionRequest, token_ids, positions) -> ChatLogProbs:
        return ChatLogProbs(content=chat_logprobs(
            self.tokenizer, token_ids, positions or [], request.top_logprobs or 0
        ))

    def _response(self, request: ChatCompletionRequest, request_id: str,
                  out: RequestOutput, tools: ToolPlan | None) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            content, calls = parse_calls(tools, comp.text) if tools else (comp.text, [])
            if calls and not (content or "").strip():
                content = None
            choices.append(ChatCompletionResponseChoice(
                index=comp.index,
                message=ChatResponseMessage(role=ROLE, content=content,
                                            tool_calls=tool_calls_json(calls)),
                logprobs=self._logprobs(request, comp.token_ids, comp.logprobs)
                if request.logprobs else None,
                finish_reason=finish_reason(tools, calls, comp.finish_reason),
                stop_reason=comp.stop_reason,
            ))
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices,
            usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens),
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
        )

    async def _stream(self, request: ChatCompletionRequest, request_id: str, stream, n: int,
                      holdback: int, tools: ToolPlan | None) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        states = [ChoiceState(holdback) for _ in range(n)]
        tool_streams = [ToolStream(tools) for _ in range(n)] if tools else None

        def chunk(index: int, delta: DeltaMessage, **kw) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name,
                choices=[ChatCompletionResponseStreamChoice(index=index, delta=delta, **kw)],
            )

        last: RequestOutput | None = None
        try:
            try:
                # The first chunk of every choice carries the role.
                for i in range(n):
                    yield sse(chunk(i, DeltaMessage(role=ROLE, content="")))
                async for out in stream:
                    last = out
                    for comp in out.outputs:
                        state = states[comp.index]
                        if state.done:
                            continue
                        finished = comp.finish_reason is not None
                        text = state.next_text(comp.text, finished)
                        calls, reason = [], comp.finish_reason
                        if tool_streams:  # text -> content and tool-call deltas
                            tool_stream = tool_streams[comp.index]
                            text, calls = tool_stream.feed(text, finished)
                            reason = finish_reason(tools, tool_stream.calls, reason)
                        logprobs = None
                        if request.logprobs:
                            new = comp.token_ids[state.sent_tokens:]
                            logprobs = self._logprobs(
                                request, new, (comp.logprobs or [])[state.sent_tokens:])
                            state.sent_tokens = len(comp.token_ids)
                        if (not text and not calls and not finished
                                and not (logprobs and logprobs.content)):
                            continue
                        state.done = finished
                        c = chunk(
                            comp.index, DeltaMessage(content=text or None,
                                                     tool_calls=calls or None),
                            logprobs=logprobs,
                            finish_reason=reason if finished else None,
                            stop_reason=comp.stop_reason if finished else None,
                        )
                        if continuous:
                            c.usage = UsageInfo.of(len(out.prompt_token_ids),
                                                   len(comp.token_ids))
                        yield sse(c)
            finally:
                stream.close()
            if include_usage and last is not None:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=UsageInfo.of(len(last.prompt_token_ids),
                                 sum(len(c.token_ids) for c in last.outputs)),
                ))
        except (EngineDeadError, EngineShutdownError) as e:
            yield sse(error_body(str(e), 503))
        except EngineStepError as e:
            yield sse(error_body(str(e), 500))
        yield DONE

