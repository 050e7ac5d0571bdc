"""POST /v1/completions: prompts (text, token ids, or lists of either), streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pagedserve.engine.async_engine import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
)
from pagedserve.entrypoints.openai.errors import APIError, error_body
from pagedserve.entrypoints.openai.offload import json_response
from pagedserve.entrypoints.openai.logprobs import (
    append_completion_logprobs,
    prompt_logprobs_json,
)
from pagedserve.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from pagedserve.entrypoints.openai.streaming import (
    DONE,
    ChoiceState,
    final_output,
    merge_streams,
    sse,
)
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """Builds engine requests from a CompletionRequest and OpenAI responses from the outputs.

    Each prompt of the list is one engine request; choice `index` is `prompt_index * n + i`.
    """

    request_fields = frozenset(CompletionRequest.model_fields)

    async def create(self, request: CompletionRequest):
        """The response (serialised, as a `Response`), or for `stream: true` an iterator of SSE
        lines (requests already accepted by the engine, so errors up to here are plain HTTP
        errors). Tokenizing and building the response run on the CPU pool."""
        prompts, per_prompt = await self.run_cpu(self._prepare, request)
        request_id = random_id("cmpl")
        streams = await self.submit(request_id, prompts, per_prompt, prompt_param="prompt")
        if request.stream:
            return self._stream(request, request_id, prompts, streams, per_prompt[0].n,
                                per_prompt[0].output_text_buffer_length)
        try:
            finals = await asyncio.gather(*(final_output(s) for s in streams))
        except BaseException as e:
            for s in streams:
                s.close()
            raise self.engine_error(e) from e
        return await self.run_cpu(
            lambda: json_response(self._response(request, request_id, prompts, finals)))

    def _prepare(self, request: CompletionRequest) -> tuple[list[Prompt], list[SamplingParams]]:
        """Check the request, tokenize its prompts, and resolve each prompt's SamplingParams."""
        self.check_model(request.model)
        self.check_fields(request)
        prompts = self._prompts(request)
        logprobs = request.logprobs
        params = self.sampling_params(request, max_tokens=request.max_tokens, logprobs=logprobs)
        if request.echo and logprobs is not None:
            # The prompt's logprobs come first in the answer.
            params.prompt_logprobs = max(logprobs, params.prompt_logprobs or 0)
        per_prompt = [
            self.for_prompt(params, len(p.token_ids), prompt_param="prompt",
                            max_tokens_param="max_tokens")
            for p in prompts
        ]
        return prompts, per_prompt

    def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        raw = request.prompt
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
        if not items:
            raise APIError("prompt must not be empty", 400, "prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError("prompt must not be empty", 400, "prompt")
                ids = self.tokenize(item, request.add_special_tokens)
                self.check_token_ids(ids, "prompt")
                prompts.append(Prompt(ids, item))
            else:
                ids = list(item)
                self.check_token_ids(ids, "prompt")
                prompts.append(Prompt(ids, None))
        return prompts

    def _prompt_text(self, prompt: Prompt, request: CompletionRequest) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids,
                                     skip_special_tokens=request.skip_special_tokens)

    def _response(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        usage = UsageInfo()
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            usage.prompt_tokens += len(out.prompt_token_ids)
            prefix = self._prompt_text(prompt, request) if request.echo else ""
            for comp in out.outputs:
                usage.completion_tokens += len(comp.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    offset = 0
                    if request.echo:
                        offset = append_completion_logprobs(
                            logprobs, self.tokenizer, out.prompt_token_ids,
                            out.prompt_logprobs or [None] * len(out.prompt_token_ids), offset,
                        )
                    append_completion_logprobs(logprobs, self.tokenizer, comp.token_ids,
                                               comp.logprobs or [], offset)
                choices.append(CompletionResponseChoice(
                    index=i * len(out.outputs) + comp.index,
                    text=prefix + comp.text,
                    logprobs=logprobs,
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
                    if request.prompt_logprobs is not None else None,
                ))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=usage)

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                      streams, n: int, holdback: int) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        states = {(i, j): ChoiceState(holdback) for i in range(len(prompts)) for j in range(n)}
        last: dict[int, RequestOutput] = {}
        want_logprobs = request.logprobs is not None
        try:
            async for i, out in merge_streams(streams):
                last[i] = out
                for comp in out.outputs:
                    state = states[(i, comp.index)]
                    if state.done:
                        continue
                    finished = comp.finish_reason is not None
                    text = state.next_text(comp.text, finished)
                    logprobs = None
                    if want_logprobs:
                        logprobs = CompletionLogProbs()
                    if request.echo and not state.started:
                        text = self._prompt_text(prompts[i], request) + text
                        if logprobs is not None:
                            state.text_offset = append_completion_logprobs(
                                logprobs, self.tokenizer, out.prompt_token_ids,
                                out.prompt_logprobs or [None] * len(out.prompt_token_ids),
                                state.text_offset,
                            )
                    if logprobs is not None:
                        new = comp.token_ids[state.sent_tokens:]
                        state.text_offset = append_completion_logprobs(
                            logprobs, self.tokenizer, new,
                            (comp.logprobs or [])[state.sent_tokens:], state.text_offset,
                        )
                        state.sent_tokens = len(comp.token_ids)
                    if not text and not finished and not (logprobs and logprobs.tokens):
                        continue
                    state.started = True
                    state.done = finished
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[CompletionResponseStreamChoice(
                            index=i * n + comp.index, text=text, logprobs=logprobs,
                            finish_reason=comp.finish_reason if finished else None,
                            stop_reason=comp.stop_reason if finished else None,
                        )],
                    )
                    if continuous:
                        chunk.usage = UsageInfo.of(len(out.prompt_token_ids),
                                                   len(comp.token_ids))
                    yield sse(chunk)
            if include_usage:
                prompt_tokens = sum(len(o.prompt_token_ids) for o in last.values())
                completion_tokens = sum(len(c.token_ids) for o in last.values() for c in o.outputs)
                yield sse(CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=UsageInfo.of(prompt_tokens, completion_tokens),
                ))
        except (EngineDeadError, EngineShutdownError) as e:
            yield sse(error_body(str(e), 503))
        except EngineStepError as e:
            yield sse(error_body(str(e), 500))
        yield DONE

