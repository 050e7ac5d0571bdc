"""POST /v1/chat/completions: messages rendered with the chat template, streamed or not; and
vLLM's POST /v1/chat/completions/batch: several conversations in one request, one choice each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.engine.async_engine import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
)
from pagedserve.engine.chat_template import flatten_content, render_chat
from pagedserve.entrypoints.openai.errors import APIError, error_body
from pagedserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from pagedserve.entrypoints.openai.offload import json_response
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
from pagedserve.entrypoints.openai.reasoning import ReasoningPlan, plan_reasoning
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
from pagedserve.sampling_params import SamplingParams

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    """Chat completions: one engine request per call, `n` choices."""

    request_fields = frozenset(ChatCompletionRequest.model_fields)

    def __init__(self, engine, settings, pool=None) -> None:
        super().__init__(engine, settings, pool)
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
                text = flatten_content(m.content, i)
                # --chat-template-content-format openai: a list of text parts, as LLM.chat's
                d["content"] = ([{"type": "text", "text": text}]
                                if self.settings.chat_template_content_format == "openai" else text)
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

    async def create(self, request: ChatCompletionRequest):
        """The response (serialised, as a `Response`), or for `stream: true` an iterator of SSE
        lines. Rendering, tokenizing and building the response run on the CPU pool."""
        prompt, params, tools, reasoning = await self.run_cpu(self._prepare, request)
        request_id = random_id("chatcmpl")
        (stream,) = await self.submit(request_id, [prompt], [params], prompt_param="messages",
                                      priority=request.priority, model=request.model)
        if request.stream:
            return self._stream(request, request_id, stream, params.n,
                                params.output_text_buffer_length, prompt, tools, reasoning)
        try:
            final = await final_output(stream)
        except BaseException as e:
            stream.close()
            raise self.engine_error(e, "messages") from e
        return await self.run_cpu(
            lambda: json_response(self._response(request, request_id, final, tools, reasoning)))

    async def create_batch(self, requests: list[ChatCompletionRequest]):
        """vLLM's /v1/chat/completions/batch: one engine request per conversation, answered
        together in one chat completion whose choice i is conversation i's (usage summed). The
        requests come from `vllm_routes.batch_chat_requests` (no streaming, tools, n > 1)."""
        prepared = [await self.run_cpu(self._prepare, r) for r in requests]
        request_id = random_id("chatcmpl")
        streams = await self.submit(request_id, [p[0] for p in prepared],
                                    [p[1] for p in prepared], prompt_param="messages",
                                    priority=requests[0].priority if requests else 0,
                                    model=requests[0].model if requests else None)
        try:
            finals = await asyncio.gather(*(final_output(s) for s in streams))
        except BaseException as e:
            for s in streams:
                s.close()
            raise self.engine_error(e, "messages") from e

        def build():
            choices, completion_tokens = [], 0
            for i, (request, out, p) in enumerate(zip(requests, finals, prepared)):
                one = self._response(request, request_id, out, None, p[3])
                for choice in one.choices:
                    choice.index = i
                choices += one.choices
                completion_tokens += one.usage.completion_tokens
            return json_response(ChatCompletionResponse(
                id=request_id, model=self.served_name(requests[0].model if requests else None),
                choices=choices,
                usage=self.usage(list(finals), completion_tokens)))

        return await self.run_cpu(build)

    def _prepare(self, request: ChatCompletionRequest
                 ) -> tuple[Prompt, SamplingParams, ToolPlan | None, ReasoningPlan | None]:
        """Check the request, render and tokenize its conversation; its SamplingParams, its
        tool plan (None without tools, or with tool_choice "none") and its reasoning plan (None
        without --reasoning-parser)."""
        self.check_model(request.model)
        self.check_fields(request)
        top = request.top_logprobs
        self.check_logprobs("top_logprobs", top)
        if top and not request.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        max_tokens, max_param = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_param = request.max_tokens, "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"{max_param} must be at least 1, got {max_tokens}", 400, max_param)
        tools, structured = self._tools(request)
        # --default-chat-template-kwargs under the request's own
        kwargs = {**(self.settings.default_chat_template_kwargs or {}),
                  **(request.chat_template_kwargs or {})} or None
        show_tools = tools is not None and not (
            self.settings.exclude_tools_when_tool_choice_none and request.tool_choice == "none")
        prompt = self.render(
            request.messages, chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=({**(kwargs or {}), "tools": tools.tools} if show_tools else kwargs),
            add_special_tokens=request.add_special_tokens,
        )
        prompt = self.truncate(prompt, request)
        params = self.sampling_params(
            request, max_tokens=max_tokens,
            logprobs=(top or 0) if request.logprobs else None, logprobs_param="top_logprobs",
            extra_stop_token_ids=self.chat_format.stop_token_ids, structured_outputs=structured,
        )
        params = self.for_prompt(params, len(prompt.token_ids), prompt_param="messages",
                                 max_tokens_param=max_param)
        if tools is not None and not tools.makes_calls:  # "none": the template has seen them
            tools = None
        if ((tools is not None and tools.parser is not None
             and not tools.parser.skip_special_tokens)
                or (self.reasoner is not None and not self.reasoner.skip_special_tokens)):
            # NOTE: the parser's markers are special tokens: the text must keep them (vLLM's
            # adjust_request does the same).
            params.skip_special_tokens = False
        reasoning = plan_reasoning(self.reasoner, kwargs,
                                   prompt.token_ids, request.include_reasoning)
        return prompt, params, tools, reasoning

    def _tools(self, request: ChatCompletionRequest):
        """The request's tool plan (None without tools) and its structured-output constraint:
        the one `required` / a named function enforces, else the request's own."""
        plan = plan_tools(request.tools, request.tool_choice, self.tool_parser,
                          parallel=request.parallel_tool_calls is not False)
        structured = self.structured_outputs(request)
        if plan is not None and plan.constraint is not None:
            if structured is not None:
                raise APIError(f"tool_choice {request.tool_choice!r} cannot be combined with "
                               "another structured-output constraint", 400, "tool_choice")
            structured = plan.constraint
        return plan, structured

    def _logprobs(self, request: ChatCompletionRequest, token_ids, positions) -> ChatLogProbs:
        return ChatLogProbs(content=chat_logprobs(
            self.tokenizer, token_ids, positions or [], request.top_logprobs or 0,
            self.settings.return_tokens_as_token_ids,
        ))

    def _role(self, request: ChatCompletionRequest) -> str:
        """The answer's role: --response-role (the assistant's by default), or when continuing
        the last message, its role."""
        return (self.settings.response_role if request.add_generation_prompt
                else request.messages[-1].role)

    def _echoed(self, request: ChatCompletionRequest) -> str:
        """With `echo`: the last message's content when the answer continues it (same role),
        which the answer's content then starts with (as vLLM does); else ""."""
        last = request.messages[-1]
        if not request.echo or last.role != self._role(request):
            return ""
        return flatten_content(last.content, len(request.messages) - 1)

    def _response(self, request: ChatCompletionRequest, request_id: str,
                  out: RequestOutput, tools: ToolPlan | None,
                  reasoning_plan: ReasoningPlan | None = None) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        echoed = self._echoed(request)
        want_ids = bool(request.return_token_ids)
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            reasoning, text = (reasoning_plan.split(comp.text) if reasoning_plan
                               else (None, comp.text))
            if reasoning_plan and not reasoning_plan.include:
                reasoning = None
            # NOTE: tools (and the content) are read from the text after the reasoning.
            content, calls = parse_calls(tools, text or "") if tools else (text, [])
            if calls and not (content or "").strip():
                content = None
            if content is None and echoed and not calls:
                content = ""
            choices.append(ChatCompletionResponseChoice(
                index=comp.index,
                message=ChatResponseMessage(role=self._role(request),
                                            content=None if content is None else echoed + content,
                                            tool_calls=tool_calls_json(calls),
                                            reasoning=reasoning, reasoning_content=reasoning),
                logprobs=self._logprobs(request, comp.token_ids, comp.logprobs)
                if request.logprobs else None,
                finish_reason=finish_reason(tools, calls, comp.finish_reason),
                stop_reason=comp.stop_reason,
                token_ids=list(comp.token_ids) if want_ids else None,
            ))
        return ChatCompletionResponse(
            id=request_id, model=self.served_name(request.model), choices=choices,
            usage=self.usage([out], completion_tokens),
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
            prompt_token_ids=list(out.prompt_token_ids) if want_ids else None,
        )

    async def _stream(self, request: ChatCompletionRequest, request_id: str, stream, n: int,
                      holdback: int, prompt: Prompt, tools: ToolPlan | None,
                      reasoning_plan: ReasoningPlan | None = None) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage) or (
            self.settings.enable_force_include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        want_ids = bool(request.return_token_ids)
        states = [ChoiceState(holdback) for _ in range(n)]
        prompt_tokens = len(prompt.token_ids)
        heavy = self.heavy_logprobs(request.top_logprobs if request.logprobs else None)
        tool_streams = [ToolStream(tools) for _ in range(n)] if tools else None
        splitters = [reasoning_plan.stream() for _ in range(n)] if reasoning_plan else None
        show_reasoning = reasoning_plan is not None and reasoning_plan.include

        def chunk(index: int, delta: DeltaMessage, completion_tokens: int = 0,
                  **kw) -> ChatCompletionStreamResponse:
            c = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.served_name(request.model),
                choices=[ChatCompletionResponseStreamChoice(index=index, delta=delta, **kw)],
            )
            if continuous:
                c.usage = UsageInfo.of(prompt_tokens, completion_tokens)
            return c

        last: RequestOutput | None = None
        try:
            try:
                # The first chunk of every choice carries the role (and with return_token_ids
                # the prompt's ids); with echo, the echoed content follows.
                echoed = self._echoed(request)
                for i in range(n):
                    first = chunk(i, DeltaMessage(role=self._role(request), content=""))
                    if want_ids:
                        first.prompt_token_ids = list(prompt.token_ids)
                    yield sse(first)
                    if echoed:
                        yield sse(chunk(i, DeltaMessage(content=echoed)))
                async for out in stream:
                    last = out
                    for comp in out.outputs:
                        state = states[comp.index]
                        if state.done:
                            continue
                        finished = comp.finish_reason is not None
                        text = state.next_text(comp.text, finished)
                        calls, reason, thought = [], comp.finish_reason, ""
                        if splitters:  # text -> reasoning, and the content after it
                            thought, text = splitters[comp.index].feed(text, finished)
                            thought = thought if show_reasoning else ""
                        if tool_streams:  # text -> content and tool-call deltas
                            tool_stream = tool_streams[comp.index]
                            text, calls = tool_stream.feed(text, finished)
                            reason = finish_reason(tools, tool_stream.calls, reason)
                        new = comp.token_ids[state.sent_tokens:]
                        logprobs = None
                        if request.logprobs:
                            logprobs = await self.off_loop_if(
                                heavy, self._logprobs, request, new,
                                (comp.logprobs or [])[state.sent_tokens:])
                        if (not text and not calls and not finished and not thought
                                and not (logprobs and logprobs.content)):
                            continue  # NOTE: its tokens go with the next chunk sent
                        state.sent_tokens = len(comp.token_ids)
                        state.done = finished
                        yield await self.off_loop_if(heavy, sse, chunk(
                            comp.index, DeltaMessage(content=text or None,
                                                     reasoning=thought or None,
                                                     reasoning_content=thought or None,
                                                     tool_calls=calls or None),
                            len(comp.token_ids), logprobs=logprobs,
                            finish_reason=reason if finished else None,
                            stop_reason=comp.stop_reason if finished else None,
                            token_ids=list(new) if want_ids else None,
                        ))
            finally:
                stream.close()
            if include_usage and last is not None:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.served_name(request.model),
                    choices=[],
                    usage=self.usage([last], sum(len(c.token_ids) for c in last.outputs)),
                ))
        except (EngineDeadError, EngineShutdownError) as e:
            yield sse(error_body(str(e), 503))
        except EngineStepError as e:
            yield sse(error_body(str(e), 500))
        yield DONE
