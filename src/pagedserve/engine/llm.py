"""`LLM`: offline batched generation, vLLM's Python API."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence as Seq

from tqdm import tqdm

from pagedserve.config import EngineArgs
from pagedserve.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.llm_pooling import PoolingMixin
from pagedserve.engine.llm_extras import LLMExtras
from pagedserve.inputs import prompt_list as _prompt_list
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]  # pagedserve.inputs: text, TextPrompt, TokensPrompt

# vLLM's `LLM(...)` keyword names for options of ours with another name.
VLLM_KWARG_NAMES = {"kv_cache_memory_bytes": "kv_cache_memory",
                    "num_gpu_blocks_override": "num_kv_blocks"}
# vLLM's `task=`: the runner / conversion it meant.
TASKS = {"auto": {}, "generate": {"runner": "generate"}, "embed": {"convert": "embed"},
         "embedding": {"convert": "embed"}, "classify": {"runner": "pooling"},
         "score": {"runner": "pooling"}, "reward": {"runner": "pooling"}}
# vLLM's `LLM(...)` keywords that change nothing here: what they would turn off is off already
# (the offline engine logs no periodic stats), or there is nothing to choose.
NO_EFFECT = {"disable_log_stats": "the offline engine logs no periodic stats here",
             "async_scheduling": "the engine steps synchronously here",
             "tokenizer_mode": "tokenizers are HF fast tokenizers here (auto and hf are the same)"}

logger = logging.getLogger(__name__)


def _vllm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM`'s keywords with vLLM's spellings turned into ours; ValueError naming a keyword
    that has none (or a `task` / `tokenizer_mode` value that has no meaning here)."""
    out = {}
    for key, value in kwargs.items():
        if key == "task":
            if value not in TASKS:
                raise ValueError(f"task must be one of {tuple(TASKS)}, got {value!r}")
            out.update(TASKS[value])
        elif key in NO_EFFECT:
            if key == "tokenizer_mode" and value not in ("auto", "hf"):
                raise ValueError(f"tokenizer_mode={value!r}: only 'auto' / 'hf' here "
                                 f"({NO_EFFECT[key]})")
            logger.info("%s has no effect here: %s", key, NO_EFFECT[key])
        else:
            out[VLLM_KWARG_NAMES.get(key, key)] = value
    unknown = set(out) - set(EngineArgs.field_names())
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return out


def configure_logging() -> None:
    """As vLLM does at import: pagedserve's INFO lines (the engine's start: "engine ready", its
    KV cache and concurrency) go to stderr when nothing configured logging (no handler on the
    root logger or pagedserve's); PAGEDSERVE_CONFIGURE_LOGGING=0 leaves logging alone."""
    if os.environ.get("PAGEDSERVE_CONFIGURE_LOGGING", "1") == "0":
        return
    ours = logging.getLogger("pagedserve")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def make_engine(args: EngineArgs):
    """The engine `LLM` drives: an `LLMEngine` in this process, or, with
    `data_parallel_size > 1` or `engine_core_process`, the front end of engine cores in their
    own processes (`engine/mp_engine.py`; the same calls)."""
    if args.data_parallel_size > 1 or args.engine_core_process:
        from pagedserve.engine.mp_engine import MPLLMEngine

        return MPLLMEngine(args)
    return LLMEngine(args)


class LLM(PoolingMixin, LLMExtras):
    """Generate text for a batch of prompts with continuous batching over a paged KV cache
    (or, with `runner="pooling"`, pool them: `embed`, `encode`, `score`; engine/llm_pooling.py).

    Also vLLM's `chat`, `get_default_sampling_params`, `reset_prefix_cache`, `get_metrics`,
    `sleep` / `wake_up` and `collective_rpc` (engine/llm_extras.py).

    >>> llm = LLM()                                   # the default model, SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model` and the engine options (`EngineArgs`' fields; also vLLM's names:
        `kv_cache_memory_bytes`, `num_gpu_blocks_override`, `task`, `convert`, ...)."""
        args = EngineArgs(model=model, **_vllm_kwargs(kwargs))
        configure_logging()
        self.engine = make_engine(args)
        self._finished_counts: dict[str, int] = {}  # get_metrics: requests by finish reason

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An `LLM` over an engine built from `args` (e.g. `EngineArgs.from_namespace`)."""
        llm = cls.__new__(cls)
        configure_logging()
        llm.engine = make_engine(args)
        llm._finished_counts = {}
        return llm

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name): `add_request`, `step`, `abort_request`, ..."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; return their outputs in input order.

        A prompt is a string, `{"prompt": str}` or `{"prompt_token_ids": [int, ...]}`. Every
        request is validated before any work starts: a bad one raises ValueError naming it.
        `priority`: one per prompt (lower first), with `scheduling_policy="priority"` (vLLM's).
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base model),
        with `enable_lora=True` (vLLM's).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:  # the model's generation defaults, as vLLM
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts"
                )
        engine = self.engine
        if priority is None:
            priority = [0] * len(prompts)
        priority = list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
        for p in priority:
            engine.check_priority(p)
        parsed = [self._parse_prompt(p, i) for i, p in enumerate(prompts)]
        # Validate all before adding any, so that a bad prompt leaves the engine untouched.
        for i, (text, ids) in enumerate(parsed):
            if ids is None:
                parsed[i] = (text, engine.tokenize(text))
        for (_, ids), params in zip(parsed, params_list):
            engine._validate_params(params, len(engine._validate_prompt(ids)))
        loras = self._lora_list(lora_request, len(prompts))
        order: dict[str, int] = {}
        for i, ((text, ids), params) in enumerate(zip(parsed, params_list)):
            request_id = engine.new_request_id()
            order[request_id] = i
            engine.add_request(request_id, text, params, prompt_token_ids=ids,
                               priority=priority[i], lora_request=loras[i])
        return self._run(order, "Processed prompts", use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Seq[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's API): the `beam_width` best sequences, best
        first, with their cumulative logprobs. Runs inside the engine, one group per prompt
        (`lora_request` as in `generate`)."""
        prompts = _prompt_list(prompts)
        engine = self.engine
        parsed = [self._parse_prompt(p, i) for i, p in enumerate(prompts)]
        parsed = [(t, ids if ids is not None else engine.tokenize(t)) for t, ids in parsed]
        for _, ids in parsed:
            engine._validate_prompt(ids)
        loras = self._lora_list(lora_request, len(parsed))
        order = {}
        for i, (text, ids) in enumerate(parsed):
            request_id = engine.new_request_id()
            order[request_id] = i
            engine.add_beam_request(request_id, text, params, prompt_token_ids=ids,
                                    lora_request=loras[i])
        return [
            BeamSearchOutput([
                BeamSearchSequence(
                    tokens=out.prompt_token_ids + c.token_ids, output_token_ids=c.token_ids,
                    text=c.text, cum_logprob=c.cumulative_logprob,
                    score=c.cumulative_logprob / max(len(c.token_ids), 1) ** params.length_penalty,
                    finish_reason=c.finish_reason,
                ) for c in out.outputs])
            for out in self._run(order, "Beam search", use_tqdm)
        ]

    def _run(self, order: dict[str, int], desc: str, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `order` (request id -> input position) has
        finished; their final outputs in input order. On any error they are all aborted."""
        engine = self.engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc=desc, disable=not use_tqdm)
        started, tokens_in, tokens_out = time.perf_counter(), 0, 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        outs = out.outputs
                        if isinstance(outs, list):
                            reason = outs[0].finish_reason if outs else "abort"
                            tokens_out += sum(len(c.token_ids) for c in outs)
                        else:  # a pooling request's one result: it ends with its prompt
                            reason = "stop"
                        tokens_in += len(out.prompt_token_ids or ())
                        self._finished_counts[reason] = self._finished_counts.get(reason, 0) + 1
                        if use_tqdm:  # vLLM's: the finished requests' tokens per second
                            elapsed = max(time.perf_counter() - started, 1e-9)
                            bar.postfix = (f"est. speed input: {tokens_in / elapsed:.2f} toks/s, "
                                           f"output: {tokens_out / elapsed:.2f} toks/s")
                        bar.update(1)
        except BaseException:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def _lora_list(self, lora_request, n: int) -> list:
        """One adapter (or None) per prompt, each checked (ValueError before any is queued)."""
        if not isinstance(lora_request, (list, tuple)):  # one for all (checked below)
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
        return [self.engine.lora.check(r) for r in loras]

    @staticmethod
    def _parse_prompt(p: PromptType, index: int) -> tuple[str | None, list[int] | None]:
        if isinstance(p, str):
            return p, None
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, list(p)  # a bare list of token ids
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return p.get("prompt"), list(p["prompt_token_ids"])
            if "prompt" in p and isinstance(p["prompt"], str):
                return p["prompt"], None
        raise ValueError(
            f"prompts[{index}] must be a string, {{'prompt': str}}, {{'prompt_token_ids': [...]}} "
            "or a list of token ids"
        )

