"""What completions and chat share: the model name check, refused and ignored fields, sampling
parameters from a request, length checks, and submitting requests to the async engine."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from pagedserve.engine.chat_template import ChatFormat, default_chat_format
from pagedserve.entrypoints.openai.errors import APIError, bad_request
from pagedserve.entrypoints.openai.offload import CPUPool
from pagedserve.entrypoints.openai.protocol import (
    UNSUPPORTED_FIELDS,
    PromptTokenUsageInfo,
    SamplingFields,
    UsageInfo,
)
from pagedserve.outputs import RequestOutput
from pagedserve.entrypoints.openai.structured import structured_outputs_of
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutputsParams

logger = logging.getLogger("pagedserve.server")

# Server-side bounds on stop strings (each is matched against the text after every token).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000
# Stream chunks with more logprobs per token than this are built off the event loop.
HEAVY_LOGPROBS = 20


@dataclass
class ServerSettings:
    """Server-level options (the engine's own are in EngineArgs)."""

    served_model_names: list[str]
    max_n: int = 16
    api_key: str | None = None
    protect_metrics: bool = True
    # vLLM's server flags (entrypoints/openai/cli_args.py)
    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    chat_template: str | None = None  # --chat-template (its source): replaces the default
    # tool_choice "auto": the parser of tool calls in the model's text (None: "auto" is a 400)
    tool_call_parser: str | None = None
    # The LoRA adapters served by name (`lora.serving.ServedLoRAs`, --enable-lora), or None
    loras: object | None = None
    # vLLM's chat flags: --response-role, --default-chat-template-kwargs,
    # --chat-template-content-format, --exclude-tools-when-tool-choice-none
    response_role: str = "assistant"
    default_chat_template_kwargs: dict | None = None
    chat_template_content_format: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False
    stream_interval: int = 1  # --stream-interval: a streamed chunk every this many tokens
    # --enable-log-requests / --enable-log-outputs / --max-log-len
    log_requests: bool = False
    log_outputs: bool = False
    max_log_len: int | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")


@dataclass
class Prompt:
    """One prompt of a request: its token ids and, when known, its text."""

    token_ids: list[int]
    text: str | None = None


class OpenAIServing:
    """Base of the completion and chat handlers."""

    request_fields: frozenset[str] = frozenset()

    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings,
                 pool: CPUPool | None = None) -> None:
        self.engine = engine
        self.settings = settings
        # NOTE: a request's CPU work (tokenizing, rendering, building and serialising large
        # responses) runs here, never on the event loop (see offload.py).
        self.pool = pool if pool is not None else CPUPool()
        self.tokenizer = engine.tokenizer
        llm = engine.engine
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.vocab_size
        self.max_logprobs = llm.args.max_logprobs
        self.model_name = settings.model_name
        self.reasoner = getattr(llm, "reasoner", None)  # --reasoning-parser (the engine's)
        # The model's generation defaults (--generation-config): a request field that is absent
        # takes its default, one the request sets wins (engine/generation_config.py).
        self.default_sampling = dict(getattr(llm, "default_sampling_params", None) or {})
        if self.default_sampling:
            logger.info("%s: default sampling parameters from the generation config "
                        "(--generation-config %s): %s", type(self).__name__,
                        llm.args.generation_config, self.default_sampling)
        self.chat_format = default_chat_format(self.tokenizer)
        if settings.chat_template:
            self.chat_format = ChatFormat("server", settings.chat_template,
                                          self.chat_format.stop_token_ids)

    async def run_cpu(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the CPU pool, off the event loop."""
        return await self.pool.run(fn, *args, **kwargs)

    @staticmethod
    def heavy_logprobs(k: int | None) -> bool:
        """Whether `k` logprobs per token make a stream chunk slow to build and serialise."""
        return k is not None and (k == -1 or k > HEAVY_LOGPROBS)

    @staticmethod
    async def off_loop_if(heavy: bool, fn, *args):
        """`fn(*args)`: on a thread when `heavy`, else here. NOTE: not on the CPU pool: a
        stream's chunks must not queue behind another request's tokenizing."""
        if heavy:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    # --- request checks -----------------------------------------------------------------------

    def check_model(self, model: str | None, allow_lora: bool = True) -> None:
        # NOTE: a missing or empty model means the served one (as vLLM does); a LoRA adapter's
        # name (--lora-modules) the base model with that adapter.
        if model and model not in self.settings.served_model_names and not (
                allow_lora and self.lora_for(model) is not None):
            raise APIError(f"The model `{model}` does not exist.", 404, "model")

    def lora_for(self, model: str | None):
        """The `LoRARequest` a request's `model` names, or None (the base model)."""
        loras = self.settings.loras
        return loras.get(model) if loras is not None else None

    def served_name(self, model: str | None) -> str:
        """The `model` a response names (vLLM's): the adapter's name for a request that chose a
        LoRA adapter, else the base model's (first) served name."""
        lora = self.lora_for(model)
        return lora.lora_name if lora is not None else self.model_name

    def check_fields(self, request: SamplingFields) -> None:
        """400 for a known field whose feature the engine lacks; warn about unknown ones."""
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options can only be given when stream is true", 400,
                           "stream_options")
        data = {**dict(request), **(request.model_extra or {})}
        for name, (in_use, message) in UNSUPPORTED_FIELDS.items():
            if name in data and in_use(data[name]):
                raise APIError(f"{name}: {message}", 400, name)
        ignored = [f for f in request.ignored_fields() if f not in UNSUPPORTED_FIELDS]
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s",
                           ignored)

    @staticmethod
    def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
        """The structured-output constraint of a request's fields (400 when invalid)."""
        return structured_outputs_of({**dict(request), **(request.model_extra or {})})

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(f"{param} must not be empty", 400, param)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise APIError(
                    f"{param}: token id {t} is outside the vocabulary [0, {self.vocab_size})",
                    400, param,
                )

    def sampling_params(self, request: SamplingFields, *, max_tokens: int | None,
                        logprobs: int | None, logprobs_param: str = "logprobs",
                        extra_stop_token_ids: list[int] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        ) -> SamplingParams:
        """SamplingParams for a request (max_tokens may be None: resolved per prompt).
        `structured_outputs`: the constraint, when not the one the request's fields give."""
        if structured_outputs is None:
            structured_outputs = self.structured_outputs(request)
        n = 1 if request.n is None else request.n
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                           400, "stop")
        for stop in stops:
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise APIError(f"stop: a stop string may be at most {MAX_STOP_STRING_CHARS} "
                               f"characters, got one of {len(stop)}", 400, "stop")
        if n > self.settings.max_n:
            raise APIError(f"n must be at most {self.settings.max_n} (--max-n), got {n}", 400, "n")
        if request.best_of is not None and request.best_of > n and request.stream:
            # NOTE: the n best are known only at the end, so they cannot be streamed.
            raise APIError(
                f"best_of > n is not supported with stream (got best_of={request.best_of}, "
                f"n={n}): the best sequences are known only when all have finished", 400,
                "best_of",
            )
        if request.use_beam_search:
            for name, bad, why in (
                ("stream", request.stream, "the beams are known only at the end"),
                (logprobs_param, logprobs is not None, "beams carry no per-token logprobs"),
            ):
                if bad:
                    raise APIError(f"{name} is not supported with use_beam_search: {why}", 400,
                                   name)
        for name, value in ((logprobs_param, logprobs), ("prompt_logprobs",
                                                          request.prompt_logprobs)):
            self.check_logprobs(name, value)
        # NOTE: beam search keeps the neutral defaults (its beams are scored, not sampled).
        d = {} if request.use_beam_search else self.default_sampling
        try:
            return SamplingParams(
                n=n,
                best_of=request.best_of,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=_default(request.repetition_penalty,
                                            d.get("repetition_penalty", 1.0)),
                temperature=_default(request.temperature,
                                     0.0 if request.use_beam_search else d.get("temperature", 1.0)),
                top_p=_default(request.top_p, d.get("top_p", 1.0)),
                top_k=_default(request.top_k, d.get("top_k", 0)),
                min_p=_default(request.min_p, d.get("min_p", 0.0)),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=list(request.stop_token_ids or []) + list(
                    extra_stop_token_ids or []),
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=request.prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=request.logit_bias,
                use_beam_search=request.use_beam_search,
                length_penalty=request.length_penalty,
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
                cache_salt=request.cache_salt,
                structured_outputs=structured_outputs,
            )
        except ValueError as e:
            raise bad_request(e, set(self.request_fields),
                              {"logprobs": logprobs_param}) from e

    def check_logprobs(self, name: str, value: int | None) -> None:
        """400 unless `value` is None, within --max-logprobs, or -1 (the whole vocabulary) with
        --max-logprobs -1."""
        if value is None:
            return
        if value < -1:
            raise APIError(f"{name} must be >= 0, or -1 for the whole vocabulary, got {value}",
                           400, name)
        if value == -1 and self.max_logprobs != -1:
            raise APIError(f"{name}=-1 (the whole vocabulary) needs --max-logprobs -1; the "
                           f"server allows at most {self.max_logprobs}", 400, name)
        if self.max_logprobs != -1 and value > self.max_logprobs:
            raise APIError(
                f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {value}",
                400, name,
            )

    def truncate(self, prompt: Prompt, request: SamplingFields) -> Prompt:
        """`prompt` cut to `truncate_prompt_tokens` tokens (-1: the model's context length),
        keeping its end (`truncation_side` "left", the default) or its start ("right")."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.max_model_len
        if keep < 1:
            raise APIError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}", 400,
                           "truncate_prompt_tokens")
        if keep > self.max_model_len:
            raise APIError(f"truncate_prompt_tokens ({keep}) is greater than the model's "
                           f"context length ({self.max_model_len})", 400,
                           "truncate_prompt_tokens")
        ids = prompt.token_ids
        if len(ids) <= keep:
            return prompt
        ids = ids[:keep] if request.truncation_side == "right" else ids[len(ids) - keep:]
        return Prompt(ids, None)

    def for_prompt(self, params: SamplingParams, prompt_len: int, *, prompt_param: str,
                   max_tokens_param: str) -> SamplingParams:
        """`params` with max_tokens resolved for a prompt; 400 when they exceed max_model_len."""
        limit = self.max_model_len
        if params.max_tokens is None:
            if prompt_len >= limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, the "
                    f"prompt is {prompt_len} tokens long, which leaves no room for a completion.",
                    400, prompt_param,
                )
            params = params.clone()
            # The generation config's max_new_tokens, within what the context leaves (vLLM's
            # get_max_tokens).
            params.max_tokens = min(limit - prompt_len,
                                    self.default_sampling.get("max_tokens") or limit)
        elif prompt_len + params.max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.", 400,
                max_tokens_param if prompt_len < limit else prompt_param,
            )
        return params

    def usage(self, outs: list[RequestOutput], completion_tokens: int) -> UsageInfo:
        """Usage of the requests behind one response (with the prompt's cached tokens under
        --enable-prompt-tokens-details)."""
        usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in outs), completion_tokens)
        if self.settings.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(
                cached_tokens=sum(o.num_cached_tokens or 0 for o in outs))
        return usage

    # --- submitting ---------------------------------------------------------------------------

    async def submit(self, request_id: str, prompts: list[Prompt],
                     params: list[SamplingParams], *, prompt_param: str,
                     priority: int = 0, model: str | None = None) -> list[RequestStream]:
        """Add one engine request per prompt, concurrently; return their streams once all were
        accepted, or abort them all and raise an APIError (400 naming `priority` for a priority
        the engine's --scheduling-policy refuses). `model`: the request's, for its adapter."""
        lora = self.lora_for(model)
        calls = [
            self.engine.add_request(
                f"{request_id}-{i}" if len(prompts) > 1 else request_id,
                p.text, sp, prompt_token_ids=p.token_ids, priority=priority,
                lora_request=lora,
            )
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            for (p, sp), stream in zip(zip(prompts, params), results):
                stream.interval = self.settings.stream_interval
                if self.settings.log_requests:
                    self._log_request(stream, p, sp)
            return list(results)
        for r in results:
            if isinstance(r, RequestStream):
                r.close()
        raise self.engine_error(errors[0], prompt_param)

    def _log_request(self, stream: RequestStream, prompt: Prompt, params: SamplingParams) -> None:
        """--enable-log-requests: one INFO line per request (its prompt and ids cut to
        --max-log-len), and with --enable-log-outputs one when it ends."""
        cut = self.settings.max_log_len
        text = prompt.text if prompt.text is None or cut is None else prompt.text[:cut]
        ids = prompt.token_ids if cut is None else prompt.token_ids[:cut]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    stream.request_id, text, params, ids)
        if self.settings.log_outputs:
            def finished(out) -> None:
                for comp in out.outputs if isinstance(out.outputs, list) else ():
                    body = comp.text if cut is None else comp.text[:cut]
                    token_ids = comp.token_ids if cut is None else comp.token_ids[:cut]
                    logger.info("Generated response %s (choice %d): output: %r, "
                                "output_token_ids: %s, finish_reason: %s", out.request_id,
                                comp.index, body, list(token_ids), comp.finish_reason)

            stream.on_finish = finished

    def engine_error(self, exc: BaseException, prompt_param: str = "prompt") -> BaseException:
        """The APIError for an exception from the async engine (others are returned as is)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, QueueFullError):
            return APIError(str(exc), 503, headers={"Retry-After": str(exc.retry_after)})
        if isinstance(exc, (EngineShutdownError, EngineDeadError)):
            return APIError(str(exc), 503)
        if isinstance(exc, EngineStepError):
            return APIError(str(exc), 500)
        if isinstance(exc, ValueError):
            return bad_request(exc, set(self.request_fields) | {prompt_param},
                               {"prompt": prompt_param})
        return exc


def _default(value, default):
    return default if value is None else value
