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
        streams = await self.submit(request_id, prompts, per_prompt, prompt_param="prompt",
                                    priority=request.priority, model=request.model)
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
        prompts = [self.truncate(p, request) for p in self._prompts(request)]
        logprobs = request.logprobs
        max_tokens = request.max_tokens
        if echo_only(request):
            # NOTE: as vLLM: one token is generated and dropped; the answer is the prompt and
            # its logprobs (how lm-evaluation-harness scores log-likelihoods).
            max_tokens = 1
        params = self.sampling_params(request, max_tokens=max_tokens, logprobs=logprobs)
        if request.echo and logprobs is not None:
            # The prompt's logprobs come first in the answer.
            params.prompt_logprobs = (-1 if -1 in (logprobs, params.prompt_logprobs)
                                      else max(logprobs, params.prompt_logprobs or 0))
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

    def _prompt_text(self, prompt: Prompt) -> str:
        """The prompt as echoed: its text, or a token-id prompt decoded with its special tokens
        (as vLLM echoes it)."""
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _echo(self, request: CompletionRequest, prompt: Prompt, out: RequestOutput,
              into: CompletionLogProbs | None, offset: int) -> tuple[str, int]:
        """The echoed prompt's text, its logprobs appended to `into`; the next text offset."""
        if into is not None:
            offset = append_completion_logprobs(
                into, self.tokenizer, out.prompt_token_ids,
                out.prompt_logprobs or [None] * len(out.prompt_token_ids), offset,
                self.settings.return_tokens_as_token_ids,
            )
        return self._prompt_text(prompt), offset

    def _response(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        only_echo = echo_only(request)
        want_ids = bool(request.return_token_ids)
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            for comp in out.outputs:
                token_ids = [] if only_echo else comp.token_ids
                completion_tokens += len(token_ids)
                logprobs = CompletionLogProbs() if request.logprobs is not None else None
                prefix = ""
                offset = 0
                if request.echo:
                    prefix, offset = self._echo(request, prompt, out, logprobs, offset)
                if logprobs is not None and not only_echo:
                    append_completion_logprobs(logprobs, self.tokenizer, token_ids,
                                               comp.logprobs or [], offset,
                                               self.settings.return_tokens_as_token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * len(out.outputs) + comp.index,
                    text=prefix + ("" if only_echo else comp.text),
                    logprobs=logprobs,
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
                    if request.prompt_logprobs is not None else None,
                    prompt_token_ids=list(out.prompt_token_ids) if want_ids else None,
                    token_ids=list(token_ids) if want_ids else None,
                ))
        return CompletionResponse(id=request_id, model=self.served_name(request.model),
                                  choices=choices,
                                  usage=self.usage(finals, completion_tokens))

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                      streams, n: int, holdback: int) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage) or (
            self.settings.enable_force_include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        states = {(i, j): ChoiceState(holdback) for i in range(len(prompts)) for j in range(n)}
        last: dict[int, RequestOutput] = {}
        want_logprobs = request.logprobs is not None
        only_echo = echo_only(request)
        want_ids = bool(request.return_token_ids)
        as_ids = self.settings.return_tokens_as_token_ids
        heavy = self.heavy_logprobs(request.logprobs)
        try:
            async for i, out in merge_streams(streams):
                last[i] = out
                for comp in out.outputs:
                    state = states[(i, comp.index)]
                    if state.done:
                        continue
                    finished = comp.finish_reason is not None
                    text = state.next_text(comp.text, finished)
                    logprobs = CompletionLogProbs() if want_logprobs else None
                    first = not state.started
                    if request.echo and first:
                        echoed, state.text_offset = await self.off_loop_if(
                            heavy, self._echo, request, prompts[i], out, logprobs,
                            state.text_offset)
                        text = echoed + ("" if only_echo else text)
                    elif only_echo:
                        text = ""
                    new = [] if only_echo else comp.token_ids[state.sent_tokens:]
                    if logprobs is not None and new:
                        state.text_offset = await self.off_loop_if(
                            heavy, append_completion_logprobs, logprobs, self.tokenizer, new,
                            (comp.logprobs or [])[state.sent_tokens:], state.text_offset, as_ids,
                        )
                    if not text and not finished and not (logprobs and logprobs.tokens):
                        continue  # NOTE: its tokens go with the next chunk sent
                    state.sent_tokens = len(comp.token_ids)
                    state.started = True
                    state.done = finished
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=self.served_name(request.model),
                        choices=[CompletionResponseStreamChoice(
                            index=i * n + comp.index, text=text, logprobs=logprobs,
                            finish_reason=comp.finish_reason if finished else None,
                            stop_reason=comp.stop_reason if finished else None,
                            prompt_token_ids=list(out.prompt_token_ids)
                            if want_ids and first else None,
                            token_ids=list(new) if want_ids else None,
                        )],
                    )
                    if continuous:
                        chunk.usage = self.usage([out], 0 if only_echo else len(comp.token_ids))
                    yield await self.off_loop_if(heavy, sse, chunk)
            if include_usage:
                outs = list(last.values())
                completion_tokens = 0 if only_echo else sum(
                    len(c.token_ids) for o in outs for c in o.outputs)
                yield sse(CompletionStreamResponse(
                    id=request_id, created=created, model=self.served_name(request.model),
                    choices=[],
                    usage=self.usage(outs, completion_tokens),
                ))
        except (EngineDeadError, EngineShutdownError) as e:
            yield sse(error_body(str(e), 503))
        except EngineStepError as e:
            yield sse(error_body(str(e), 500))
        yield DONE


def echo_only(request: CompletionRequest) -> bool:
    """`echo: true, max_tokens: 0`: the prompt (and its logprobs) is the whole answer."""
    return bool(request.echo) and request.max_tokens == 0
