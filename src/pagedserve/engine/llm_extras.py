"""`LLM`'s vLLM methods beyond `generate`: `chat`, `get_default_sampling_params`,
`reset_prefix_cache`, `get_metrics`, `sleep` / `wake_up` / `is_sleeping` and `collective_rpc`.

`chat` renders each conversation with the same code as the server's /v1/chat/completions
(`engine/chat_template.py`: the tokenizer's template, a request's own, or the
documented defaults), tokenizes it without adding special tokens a second time, adds the chat
format's stop tokens (Gemma's `<end_of_turn>` for the default Gemma format) and calls `generate`
on the token ids: its outputs are exactly `generate`'s on the rendered prompt.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

CONTENT_FORMATS = ("auto", "string", "openai")


# --- get_metrics: vLLM's metric records (vllm.v1.metrics.reader) ------------------------------


@dataclass
class Metric:
    """One metric sample: vLLM's name (`vllm:...`) and labels."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


class LLMExtras:
    """Mixed into `LLM` (which provides `engine`, `generate` and `_finished_counts`)."""

    # --- chat --------------------------------------------------------------------------------

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply for one conversation (a list of `{"role", "content", ...}` messages)
        or for each of a list of conversations, with vLLM's signature. Every conversation is
        rendered and checked before any is run; a bad one raises ValueError naming it."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: this engine serves text-only models")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                             f"got {chat_template_content_format!r}")
        conversations = _conversations(messages)
        template_kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            template_kwargs["tools"] = tools
        prompts = [
            self._render_conversation(conv, f"messages[{i}]" if len(conversations) > 1
                                      else "messages", chat_template,
                                      chat_template_content_format, add_generation_prompt,
                                      continue_final_message, template_kwargs)
            for i, conv in enumerate(conversations)
        ]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        stops = self._chat_format().stop_token_ids
        if isinstance(sampling_params, SamplingParams):
            sampling_params = _with_stop_tokens(sampling_params, stops)
        else:
            sampling_params = [_with_stop_tokens(p, stops) for p in sampling_params]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _chat_format(self):
        fmt = getattr(self, "_chat_format_cache", None)
        if fmt is None:
            from pagedserve.engine.chat_template import default_chat_format

            fmt = self._chat_format_cache = default_chat_format(self._chat_tokenizer())
        return fmt

    def _chat_tokenizer(self):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine runs with skip_tokenizer_init)")
        return tokenizer

    def _render_conversation(self, conversation, where: str, chat_template, content_format,
                             add_generation_prompt, continue_final_message,
                             template_kwargs) -> dict[str, Any]:
        """`{"prompt", "prompt_token_ids"}` of one conversation, as the server renders it."""
        from pagedserve.engine.chat_template import flatten_content, render_chat

        tokenizer = self._chat_tokenizer()
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"{where} must be a non-empty list of messages")
        dicts = []
        for i, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{where}[{i}] must be a dict with a 'role' string")
            d = {k: v for k, v in message.items() if v is not None}
            text = flatten_content(message.get("content"), i)
            d["content"] = ([{"type": "text", "text": text}] if content_format == "openai"
                            else text)
            dicts.append(d)
        try:
            text = render_chat(tokenizer, dicts, self._chat_format(), chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               template_kwargs=template_kwargs)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        return {"prompt": text, "prompt_token_ids": ids}

    # --- defaults ----------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` / `chat` use when given none: the model's generation
        defaults (`generation_config`, engine/generation_config.py), else vLLM's neutral ones."""
        return SamplingParams(**self.engine.default_sampling_params)

    # --- prefix cache, metrics -------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (e.g. after the weights changed); False while
        requests hold blocks (nothing is reset then)."""
        return self.engine.kv_manager.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's counters and gauges under vLLM's names (`vllm:...`, as
        `vllm.LLM.get_metrics`): tokens, preemptions, prefix-cache queries and hits, requests
        running and waiting, KV cache usage, and the requests finished through this `LLM` by
        finish reason."""
        engine = self.engine
        labels = {"model_name": engine.source.name}
        kv, sched = engine.kv_manager, engine.scheduler
        counts = self._cache_counts()
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", dict(labels), engine.stats["prompt_tokens"]),
            Counter("vllm:generation_tokens", dict(labels), engine.stats["generation_tokens"]),
            Counter("vllm:num_preemptions", dict(labels), counts[0]),
            Counter("vllm:prefix_cache_queries", dict(labels), counts[1]),
            Counter("vllm:prefix_cache_hits", dict(labels), counts[2]),
            Gauge("vllm:num_requests_running", dict(labels), float(len(sched.running))),
            Gauge("vllm:num_requests_waiting", dict(labels), float(len(sched.waiting))),
            Gauge("vllm:kv_cache_usage_perc", dict(labels), float(kv.usage())),
        ]
        for reason, count in sorted(self._finished_counts.items()):
            out.append(Counter("vllm:request_success", {**labels, "finished_reason": reason},
                               count))
        if engine.spec is not None:  # speculative decoding (vLLM's names)
            spec = engine.spec
            out += [Counter("vllm:spec_decode_num_drafts", dict(labels), spec.num_drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", dict(labels),
                            spec.num_draft_tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", dict(labels),
                            spec.num_accepted_tokens)]
            out += [Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                            {**labels, "position": str(pos)}, count)
                    for pos, count in enumerate(spec.accepted_per_pos)]
        return out

    def _cache_counts(self) -> tuple[int, int, int]:
        """Preemptions, prefix-cache queries and hits so far, across the scheduler and block
        manager that `wake_up` rebuilds (their own counts start again at 0)."""
        base = getattr(self, "_counts_before_rebuild", (0, 0, 0))
        kv, sched = self.engine.kv_manager, self.engine.scheduler
        return (base[0] + sched.num_preemptions, base[1] + kv.prefix_queries,
                base[2] + kv.prefix_hits)

    # --- sleep / wake_up ---------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (vLLM's level 1; the weights stay where they are) until `wake_up`.
        No request may be in flight; requests while asleep are a ValueError."""
        if level != 1:
            raise ValueError(f"level must be 1 (free the KV cache), got {level!r}: level 2 "
                             "(discard the weights) is not supported")
        engine = self.engine
        if engine.sleeping:
            return
        if engine.has_unfinished_requests():
            raise ValueError("sleep: requests are in flight; let them finish first")
        try:
            engine.executor.free_cache()
        except NotImplementedError as e:
            raise ValueError(f"sleep needs the uni or mp executor: {e}") from e
        engine.kv_cache = None
        engine.sleeping = True
        gc.collect()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate the KV cache again (empty: the prefix cache starts afresh). `tags`, as
        vLLM's: what to wake up; without "kv_cache" nothing changes (the weights never left)."""
        if tags is not None and not set(tags) <= {"kv_cache", "weights"}:
            raise ValueError(f"tags must name 'kv_cache' and/or 'weights', got {tags!r}")
        engine = self.engine
        if not engine.sleeping or (tags is not None and "kv_cache" not in tags):
            return
        counts = self._cache_counts()
        engine.reconfigure_cache()
        self._counts_before_rebuild = counts
        engine.sleeping = False

    def is_sleeping(self) -> bool:
        return self.engine.sleeping

    # --- collective_rpc ----------------------------------------------------------------------

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker (a `Worker` method's name, or a function called as
        `method(worker, *args, **kwargs)`); one result per rank. The uni and mp executors."""
        if timeout is not None:
            raise ValueError("timeout is not supported")
        try:
            return self.engine.executor.collective_rpc(method, tuple(args), dict(kwargs or {}))
        except NotImplementedError as e:
            raise ValueError(f"collective_rpc needs the uni or mp executor: {e}") from e


def _conversations(messages) -> list:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of messages or a list of conversations")
    if messages and all(isinstance(m, (list, tuple)) for m in messages):
        return list(messages)
    return [messages]


def _with_stop_tokens(params: SamplingParams, stop_token_ids: list[int]) -> SamplingParams:
    """`params` with the chat format's stop tokens added (as the server adds them)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    missing = [t for t in stop_token_ids if t not in (params.stop_token_ids or [])]
    if not missing:
        return params
    params = params.clone()
    params.stop_token_ids = list(params.stop_token_ids or []) + missing
    return params


__all__ = ["Counter", "Gauge", "LLMExtras", "Metric"]
