"""The engine loop: add requests, then `step()`: schedule -> run the model -> process outputs."""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any, Callable

import torch

from pagedserve.attention.kv_dtype import is_fp8, kv_cache_dtype
from pagedserve.config import EngineArgs
from pagedserve.core.beam_search import BeamSearchParams, BeamState
from pagedserve.core.kv_cache_manager import KVCacheManager, KVManagerConfig
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.core.spec_decode import make_spec_decoder, record_spec_rows
from pagedserve.core.step_input import StepInput
from pagedserve.engine.cache_setup import CacheSetup
from pagedserve.engine.context_length import served_max_model_len
from pagedserve.engine.pooling import (check_pooling_fits, check_runner, hidden_size,
                                       pooling_spec, resolve_runner)
from pagedserve.engine.detokenizer import (
    IncrementalDetokenizer,
    TokenizerInfo,
    find_stop,
)
from pagedserve.engine.gc_pause import freeze_startup_heap, gc_paused
from pagedserve.engine.generation_config import diff_sampling_params
from pagedserve.engine.output_builder import OutputBuilder
from pagedserve.engine.spec_draft import check_draft_tokenizer, resolve_draft
from pagedserve.lora.engine import LoRAChecker, LoRAEngineMixin, cache_key
from pagedserve.models.loader import release_freed_memory, resolve_dtype
from pagedserve.platforms import default_device, platform_for
from pagedserve.models.source import resolve_model
from pagedserve.models.tokenizer import bad_words_token_ids, eos_token_ids
from pagedserve.outputs import RequestOutput
from pagedserve.pooling_params import PoolerConfig, PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup
from pagedserve.reasoning import make_reasoning_parser
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.worker.executor import make_executor
from pagedserve.worker.kv_cache import bytes_per_block
from pagedserve.core.step_output import SeqStepOutput

logger = logging.getLogger(__name__)


def _text_config(config):
    return getattr(config, "text_config", None) or config


class _NoDetokenizer:
    """Stands in for the incremental detokenizer under `skip_tokenizer_init`: no text."""

    text = ""

    def append(self, token_ids) -> str:
        return ""


class LLMEngine(OutputBuilder, LoRAEngineMixin, CacheSetup):
    """One model, its KV cache, a scheduler and a model runner, driven step by step.

    `add_request` validates and queues a request (ValueError names the bad parameter, and the
    engine is unchanged); `step` runs one iteration for every request in flight and returns the
    outputs of the requests that advanced; `abort_request` frees a request's blocks at once.

    `kv_manager_factory` builds the KV block manager from the engine's sizes (default
    `KVCacheManager.from_config`: paging). Benchmarks plug other managers in here (the Orca-style
    baselines of `bench/contiguous.py`), tests a shuffled free list.
    """

    def __init__(self, args: EngineArgs,
                 kv_manager_factory: Callable[[KVManagerConfig], KVCacheManager] | None = None,
                 ) -> None:
        self.args = args
        if args.require_kernels:  # before anything slow: no silent torch fallback
            from pagedserve.kernels.extension import require_kernels

            require_kernels()
        self.kv_manager_factory = kv_manager_factory or KVCacheManager.from_config
        self.source = resolve_model(args.model, args.load_format, revision=args.revision,
                                    download_dir=args.download_dir)
        if args.hf_overrides:
            self.source.apply_overrides(args.hf_overrides)
            logger.info("hf_overrides: %s set over the model's config", sorted(args.hf_overrides))
        if args.trust_remote_code:
            logger.info("trust_remote_code: accepted; pagedserve never runs code from a model's "
                        "files, with or without it (its own model classes only)")
        config = self.source.config
        self.model_config = _text_config(config)
        self.device = torch.device(default_device() if args.device == "auto" else args.device)
        self.platform = platform_for(self.device)  # the driver's view of the workers' device
        self.dtype = resolve_dtype(args.dtype, config, self.device, self.platform)
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)  # the blocks' storage
        if is_fp8(self.kv_dtype) and self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r}: fp8 KV blocks are "
                             f"implemented on CPU only (device {self.device}); use 'auto'")
        if is_fp8(self.kv_dtype) and args.attention_backend == "triton":
            raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype!r}: fp8 KV blocks are read "
                             "by the torch attention backend only; use attention_backend='auto' "
                             "or 'torch'")
        self.max_model_len = served_max_model_len(args.max_model_len, config, self.model_config)
        # The model workers: in this process, or one process / Ray actor per tensor-parallel rank.
        draft = resolve_draft(args, self.source)  # speculative decoding's draft model, or None
        self.executor = make_executor(args, self.source, self.dtype, self.device, draft=draft)
        self.model = self.executor.model  # None when the model lives in worker processes
        self.vocab_size = int(self.model_config.vocab_size)
        if args.skip_tokenizer_init:  # token ids in, token ids out (EOS from the config)
            self.tokenizer = self.tokenizer_info = None
            self.eos_token_ids = sorted(eos_token_ids(None, config, model_path=self._model_dir()))
        else:
            self.tokenizer = self.source.load_tokenizer(args.tokenizer, args.tokenizer_revision)
            self.eos_token_ids = sorted(eos_token_ids(self.tokenizer, config))
            self.tokenizer_info = TokenizerInfo.from_tokenizer(self.tokenizer)
            check_draft_tokenizer(draft, self.tokenizer)
            release_freed_memory()  # what building the tokenizer left behind in the heap

        name = getattr(args, "reasoning_parser", None)  # structured outputs wait for its end
        self.reasoner = make_reasoning_parser(name, self.tokenizer) if name else None
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids,
            disable_any_whitespace=args.structured_outputs_disable_any_whitespace,
            reasoner=self.reasoner)
        # "generate" or "pooling" (embeddings: prefill-only requests, see engine/pooling.py)
        self.runner = resolve_runner(args.runner, config)
        self.pooler_config = None
        if self.runner == "pooling":
            self.pooler_config = PoolerConfig.resolve(args.pooler_config, self._model_dir())
            logger.info("pooling runner: pooling_type=%s normalize=%s (from %s)",
                        self.pooler_config.pooling_type, self.pooler_config.normalize,
                        self.pooler_config.source)
        self.lora = LoRAChecker(args.lora_config(), self.model_config)  # enable_lora (lora/)
        self._seq_ids = itertools.count()
        self.spec = make_spec_decoder(args, self.runner)  # speculative decoding, or None
        # the (block_size, kv_cache_dtype) a recurrent state's entries are bound to (the workers
        # bound them at load: WorkerConfig)
        self._state_bound = (args.block_size, args.kv_cache_dtype)
        self._build_cache(args)
        self._request_ids = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}
        self._step_sched: SchedulerOutput | None = None  # see step_request_ids()
        self._step_ids_stamp = -1  # stats["steps"] when they were recorded
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        # The model's generation defaults (engine/generation_config.py): request fields win.
        self.default_sampling_params = diff_sampling_params(
            self.source, args.generation_config, args.override_generation_config)
        self.sleeping = False  # LLM.sleep (engine/llm_extras.py): KV cache freed, no request taken
        freeze_startup_heap()  # full collections skip the startup heap (engine/gc_pause.py)
        kv_bytes = self.num_kv_blocks * bytes_per_block(
            self.executor.kv_cache_spec, args.block_size, self.kv_dtype,
            draft=self.executor.draft_kv_cache_spec, hybrid=self.kv_hybrid)
        # a token's K/V over every layer (fp8 blocks: half a bf16 cache's, attention/kv_dtype.py)
        token_bytes = bytes_per_block(self.executor.kv_cache_spec, 1, self.kv_dtype,
                                      draft=self.executor.draft_kv_cache_spec, hybrid=False)
        logger.info(
            "engine ready: model=%s dtype=%s kv_cache_dtype=%s (%s, %d KV bytes per token) "
            "device=%s kv_blocks=%d x %d tokens (max %d tokens in cache, %.2f GiB), "
            "max_model_len=%d, maximum concurrency for %d tokens per request: %.2fx",
            self.source.name, self.dtype, args.kv_cache_dtype,
            str(self.kv_dtype).removeprefix("torch."), token_bytes, self.device,
            self.num_kv_blocks, args.block_size,
            self.num_kv_blocks * args.block_size, kv_bytes / 2**30, self.max_model_len,
            self.max_model_len, self.max_concurrency,  # the layout's (see _build_cache)
        )

    def _model_dir(self):
        path = getattr(self.source, "path", None)
        return path if path is not None and os.path.isdir(path) else None

    # --- requests ----------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._request_ids))

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: the engine runs without a tokenizer (skip_tokenizer_init): "
                             "give prompt_token_ids")
        return list(self.tokenizer(prompt).input_ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | PoolingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> SequenceGroup:
        """Validate and queue one request: a generation request (`SamplingParams`) or, with
        `runner="pooling"`, a pooling one (`PoolingParams`). Raises ValueError (naming the
        problem) and leaves the engine untouched when the request cannot be served. `priority`
        (lower first) needs `scheduling_policy="priority"`; `lora_request` (a
        `LoRARequest`) runs it with that adapter (`enable_lora`)."""
        if self.sleeping:
            raise ValueError("the engine is asleep (its KV cache is freed): call wake_up() first")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self.check_priority(priority)
        check_runner(self.runner, params)
        lora_request = self.lora.check(lora_request)
        pooling = None
        if isinstance(params, PoolingParams):
            pooling = pooling_spec(params, self.pooler_config, self.model_config,
                                   self.source.name, hidden_size(self.model_config))
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: either a prompt or prompt_token_ids is required")
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = self._validate_prompt(prompt_token_ids)
        if pooling is not None:
            params = self._validate_pooling(len(prompt_token_ids))
        else:
            params = self._validate_params(params, len(prompt_token_ids))
        beam = None
        if params.use_beam_search:  # one group whose live sequences are the beams
            beam = BeamState(BeamSearchParams(
                beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                length_penalty=params.length_penalty))
        group = SequenceGroup(
            request_id=request_id,
            seqs=[],
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            prompt=prompt,
            priority=priority,
            lora_request=lora_request,
        )
        for index in range(1 if beam else params.best_of or params.n):
            seq = Sequence(next(self._seq_ids), prompt_token_ids, index)
            seq.cache_salt = cache_key(params.cache_salt, lora_request)
            if beam:  # beams fork every step: their text is decoded once, at the end
                group.seqs.append(seq)
                continue
            if self.tokenizer is None or pooling is not None:
                seq.detokenizer = _NoDetokenizer()
                group.seqs.append(seq)
                continue
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                tokenizer_info=self.tokenizer_info,
            )
            group.seqs.append(seq)
        group.fork_pending = len(group.seqs) > 1
        group.beam = beam
        group.pooling = pooling
        final_len = min(self.max_model_len, len(prompt_token_ids) + params.max_tokens)
        for seq in group.seqs:
            self.kv_manager.on_admit(seq.seq_id, len(prompt_token_ids), final_len)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        if params.structured_outputs is not None:  # one grammar matcher per sequence
            self.structured.attach(group, params.structured_outputs, prompt_token_ids)
        self.scheduler.add(group)
        self.groups[request_id] = group
        return group

    def check_priority(self, priority) -> None:
        """Raise ValueError unless `priority` is an integer the scheduling policy accepts (any
        under "priority", only 0 under "fcfs", as vLLM)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority}: request priorities need --scheduling-policy priority "
                "(scheduling_policy='priority'); this engine schedules fcfs")

    def _validate_prompt(self, ids) -> list[int]:
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError) as e:
            raise ValueError("prompt_token_ids must be a list of integers") from e
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, more than max_model_len ({self.max_model_len})"
            )
        return ids

    def _resolve_token_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the vocabulary-dependent fields resolved (a copy when any changes):
        logprobs -1 (the whole vocabulary, with max_logprobs -1), bad_words to token ids, and
        allowed_token_ids checked against the vocabulary."""
        bad = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        whole = [n for n in ("logprobs", "prompt_logprobs") if getattr(params, n) == -1]
        if not whole and not (params.bad_words and params.bad_words_token_ids is None):
            return params
        params = params.clone()
        for name in whole:
            if self.args.max_logprobs != -1:
                raise ValueError(f"{name}=-1 (the whole vocabulary) needs max_logprobs=-1, "
                                 f"the engine has {self.args.max_logprobs}")
            setattr(params, name, self.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (the engine runs with "
                                 "skip_tokenizer_init)")
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        return params

    def _validate_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        check_runner(self.runner, params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (the engine runs with "
                             "skip_tokenizer_init); use stop_token_ids")
        params = self._resolve_token_params(params)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and self.args.max_logprobs != -1 and value > self.args.max_logprobs:
                raise ValueError(
                    f"{name}={value} is more than max_logprobs ({self.args.max_logprobs})"
                )
        width = params.best_of or params.n
        if width > self.args.max_num_seqs:
            name = "n" if params.use_beam_search or params.best_of is None else "best_of"
            raise ValueError(
                f"{name}={width} is more than max_num_seqs ({self.args.max_num_seqs}): the "
                "request could never be scheduled (raise max_num_seqs)")
        if params.use_beam_search and self.spec is not None:
            raise ValueError("use_beam_search: beam search cannot run with speculative decoding "
                             "(speculative_config is set on this engine)")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary")
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = self.max_model_len - prompt_len
        self.kv_manager.check_request(
            width, params.use_beam_search, prompt_len,
            min(self.max_model_len, prompt_len + params.max_tokens))
        # NOTE: the one limit of the KV pool: one sequence alone must fit it. Its last sampled
        # token is never computed; sequences that cannot all fit at once take turns.
        final = min(self.max_model_len, prompt_len + params.max_tokens)
        blocks = self.kv_manager.blocks_for(final - 1,
                                            self.scheduler_config.max_num_batched_tokens)
        if blocks > self.num_kv_blocks:
            raise ValueError(
                f"max_tokens: a sequence of {prompt_len} prompt tokens and up to "
                f"{final - prompt_len} output tokens (max_tokens) needs {blocks} KV blocks alone; "
                f"the cache has {self.num_kv_blocks} (lower max_tokens, shorten the prompt or "
                "raise kv_cache_memory / num_kv_blocks)")
        return params

    def _validate_pooling(self, prompt_len: int) -> SamplingParams:
        """A pooling request's check (its prompt's blocks fit the cache); its SamplingParams."""
        return check_pooling_fits(prompt_len, self.kv_manager, self.num_kv_blocks)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. Returns False if it is unknown."""
        group = self.scheduler.abort(request_id)
        self.groups.pop(request_id, None)
        if group is not None:
            self._forget(group)
        return group is not None

    def _forget(self, group: SequenceGroup) -> None:
        """Tell the KV manager that a request ended (finished or aborted)."""
        for seq in group.seqs:
            self.kv_manager.on_finish(seq.seq_id)
        if self.spec is not None:
            self.spec.forget(seq.seq_id for seq in group.seqs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a model worker has died (cheap: call it between steps)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the model workers (processes or Ray actors); no step can run afterwards."""
        self.executor.shutdown()

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns an output for every request that produced tokens or finished.

        NOTE (step cost): the cyclic garbage collector is paused during the step and runs after
        it, over what the step left alive (engine/gc_pause.py).
        """
        with gc_paused():
            return self._run_step()

    def _run_step(self) -> list[RequestOutput]:
        self._step_sched = None
        started = time.perf_counter()
        if self.spec is not None:
            # draft tokens for the decoding sequences (the grammar's prefix of them)
            self.spec.propose(self.scheduler.running, self.scheduler.max_model_len,
                            self.structured.valid_drafts)
            self.spec.draft_seconds += time.perf_counter() - started
        sched = self.scheduler.schedule()
        # NOTE: recorded before the model runs, so that a step that raises can be pinned on the
        # requests it touched (see step_request_ids; their ids are listed only when asked).
        self._step_sched = sched
        self._step_ids_stamp = self.stats["steps"]  # a step that completes moves past it
        now = time.monotonic()
        step = StepInput.from_schedule(sched)
        step.grammar_bitmask = self.structured.bitmask_for(sched)  # structured outputs
        drafted = self.executor.draft_seconds  # (a draft model's time, in the workers)
        results = self.executor.execute(step)
        for s in sched.scheduled:
            if s.group.first_scheduled_time is None:
                s.group.first_scheduled_time = now
        update = self.scheduler.update_from_output(sched, results, self)
        self.stats["steps"] += 1
        self._step_sched = None  # the step completed: nothing to pin on its requests
        self.stats["prompt_tokens"] += update.num_prompt_tokens
        self.stats["generation_tokens"] += update.num_generated_tokens
        if self.spec is not None:
            record_spec_rows(self.spec, update.spec_rows)
            self.spec.draft_seconds += self.executor.draft_seconds - drafted
            self.spec.step_seconds += time.perf_counter() - started
        outputs = []
        for group in update.groups:
            finished = group.is_finished
            if finished:
                group.finished_time = time.monotonic()
                self.groups.pop(group.request_id, None)
                self._forget(group)
            outputs.append(self._make_output(group, finished))
        return outputs

    # --- the scheduler's StepObserver: what needs the tokenizer --------------------------------

    def on_prompt_logprobs(self, s, r: SeqStepOutput) -> None:
        """Format a prompt chunk's logprobs into the group's `prompt_logprobs`."""
        group = s.group
        ids = s.seq.token_ids
        for offset, (lp, rank, top) in enumerate(r.prompt_logprobs):
            token = ids[s.start + 1 + offset]
            group.prompt_logprobs.append(self._logprob_dict(token, lp, rank, top))

    def on_token(self, group: SequenceGroup, seq: Sequence, res, check_stop: bool,
                 stops: bool) -> bool:
        """Record a new token's logprobs, detokenize it; True if a stop string matched.
        `stops`: the token ends the sequence as an EOS / stop token id (core/step_update's
        rule)."""
        params = group.sampling_params
        token = res.token_id
        if res.top_logprobs is not None:
            seq.output_logprobs.append(
                self._logprob_dict(token, res.logprob, res.rank, res.top_logprobs)
            )
        detok: IncrementalDetokenizer = seq.detokenizer
        if stops and not params.include_stop_str_in_output:
            # NOTE: as vLLM, the EOS / stop token that ends a sequence keeps its id in the
            # output but not its text (with skip_special_tokens=False it would show up).
            seq.final_text = detok.text  # the text before this token
        new_text = detok.append(token if type(token) is int else [token])
        # NOTE: the matcher accepts every token; a grammar that has ended stops the sequence
        # (before min_tokens, as vLLM: the grammar wins). (An empty `extra`: no grammar.)
        if group.extra and self.structured.accept(group, seq, token):
            return True
        if check_stop and params.stop and new_text:
            cut, matched = find_stop(
                detok.text, len(new_text), params.stop, params.include_stop_str_in_output
            )
            if matched is not None:
                seq.final_text = detok.text[:cut]
                seq.stop_reason = matched
                return True
        return False

    # --- beam search -------------------------------------------------------------------------

    def add_beam_request(
        self, request_id: str, prompt: str | None, params: BeamSearchParams,
        prompt_token_ids: list[int] | None = None, priority: int = 0, lora_request=None,
    ) -> SequenceGroup:
        """Queue a beam search: one group whose live sequences are the beams (the same as
        `add_request` with `SamplingParams(use_beam_search=True, n=beam_width, ...)`)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                  ignore_eos=params.ignore_eos, n=params.beam_width,
                                  use_beam_search=True, length_penalty=params.length_penalty)
        return self.add_request(request_id, prompt, sampling, prompt_token_ids,
                                priority=priority, lora_request=lora_request)

    # --- introspection -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError if the scheduler's queues, the block tables and the pool disagree."""
        self.scheduler.check_invariants()

    def num_used_blocks(self) -> int:
        return self.kv_manager.pool.num_used

    def step_request_ids(self) -> list[str]:
        """The requests the step in progress, or the step that last raised, scheduled or
        preempted, in order; empty once a step completed after them, or if the step raised
        before scheduling. After a step raises, these are the requests whose state may be
        half-updated: abort them (`abort_request`) before stepping again."""
        sched = self._step_sched
        if self._step_ids_stamp != self.stats["steps"] or sched is None:
            return []
        return list(dict.fromkeys([s.group.request_id for s in sched.scheduled]
                                  + [g.request_id for g in sched.preempted]))

    def last_schedule_info(self) -> dict[str, Any]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": self.kv_manager.usage(),
            "swapped": len(self.scheduler.swapped),
            "cpu_kv_usage": (self.kv_manager.cpu_pool.num_used / self.kv_manager.cpu_pool.num_blocks
                             if self.kv_manager.cpu_pool else 0.0),
            "preemptions_by_mode": dict(self.scheduler.preemptions_by_mode),
            "prefix_cache_hit_rate": self.kv_manager.prefix_cache_hit_rate(),
            "preemptions": self.scheduler.num_preemptions,
            # per layer group (several, or a sliding window): (name, share of the pool's blocks
            # it holds, share of its held slots that no query reads)
            "kv_groups": self.kv_group_usage() if self.kv_manager.has_groups else [],
        }

    def kv_group_usage(self) -> list[tuple[str, float, float]]:
        """Per KV layer group (core/kv_spec.py): (name, fraction of the pool's blocks it holds,
        fraction of its held token slots that hold nothing a query reads: its waste)."""
        kv = self.kv_manager
        return [(name, blocks / kv.num_blocks, max(0.0, 1.0 - live / held) if held else 0.0)
                for name, blocks, held, live in kv.group_stats()]


__all__ = ["LLMEngine", "SchedulerOutput"]
