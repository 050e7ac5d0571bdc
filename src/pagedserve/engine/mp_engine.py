"""The front end over engine cores in other processes: `FrontEnd` (shared), and `MPLLMEngine`,
the synchronous engine `LLM` drives when the cores run apart (`data_parallel_size > 1`, or
`engine_core_process=True`).

The front end owns the tokenizer, the `Processor` (text -> `CoreRequest`), the
`OutputProcessor` (token deltas -> `RequestOutput`s), the `Router` (which core takes a request)
and the `CoreClient` (the cores and their sockets). It reads the model's configuration itself
(`resolve_model`: the config and tokenizer files, never the weights) and the engine's sizes from
the cores' handshakes, so callers see the same attributes as on an `LLMEngine` (`source`,
`tokenizer`, `max_model_len`, `vocab_size`, `args`, `model_config`, `runner`,
`default_sampling_params`, `kv_manager`'s sizes).

Faults: a core that dies takes the requests it was running with it: each ends with
`EngineCoreDiedError` naming the engine; the requests routed to it that produced nothing yet
(waiting, or scheduled in the step it died in) are sent to another live core, so a caller never
sees their loss. The other cores serve on; the lost one is restarted when `restart_lost_cores`
is set (mp backend), otherwise the front end reports it lost (`lost_engines`, the server's
/health). With no core left, every request fails and new ones are refused.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pagedserve.config import EngineArgs
from pagedserve.engine.core_client import CoreClient, CoreDied, EngineCoreDiedError
from pagedserve.engine.core_messages import (
    CoreAbort,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    CoreStopSeqs,
)
from pagedserve.engine.dp_router import Router
from pagedserve.engine.kv_events import KVEventsConfig
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.processor import Processor
from pagedserve.engine.stats import StepStats
from pagedserve.lora.engine import LoRAChecker
from pagedserve.outputs import RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Handled:
    """What one message from the cores meant to the front end."""

    outputs: list = field(default_factory=list)  # RequestOutput / PoolingRequestOutput
    accepted: list[str] = field(default_factory=list)
    errors: list[tuple[str, Exception]] = field(default_factory=list)
    stats: StepStats | None = None
    engine_index: int | None = None
    died: CoreDied | None = None


@dataclass
class _InFlight:
    """A request the front end routed: its core, its message (kept to route it again while it
    has produced nothing), its load on the core."""

    core: int
    request: CoreRequest | None
    load: int
    prompt_len: int
    accepted: bool = False


class FrontEnd:
    """Everything but the serving loop (see the module docstring). Thread-safety: `submit` /
    `abort` may be called from one thread while another calls `handle`; both take `_lock`."""

    def __init__(self, args: EngineArgs) -> None:
        from pagedserve.engine.generation_config import diff_sampling_params
        from pagedserve.engine.llm_engine import _text_config
        from pagedserve.models.source import resolve_model
        from pagedserve.reasoning import make_reasoning_parser

        self.args = args
        self.source = resolve_model(args.model, args.load_format)
        self.model_config = _text_config(self.source.config)
        self.tokenizer = (None if args.skip_tokenizer_init
                          else self.source.load_tokenizer(args.tokenizer))
        kv_events = KVEventsConfig.parse(args.kv_events_config)
        self.client = CoreClient(args, kv_events)
        ready = self.client.ready[0]
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.runner = ready.runner
        self.eos_token_ids = list(ready.eos_token_ids)
        self.num_kv_blocks = ready.num_kv_blocks
        self.num_cpu_blocks = ready.num_cpu_blocks
        self.kv_manager = SimpleNamespace(
            block_size=ready.block_size, num_blocks=ready.num_kv_blocks,
            cpu_pool=SimpleNamespace(num_blocks=ready.num_cpu_blocks, num_used=0)
            if ready.num_cpu_blocks else None,
            enable_prefix_caching=args.enable_prefix_caching)
        name = getattr(args, "reasoning_parser", None)
        self.reasoner = make_reasoning_parser(name, self.tokenizer) if name else None
        self.default_sampling_params = diff_sampling_params(
            self.source, args.generation_config, args.override_generation_config)
        self.lora = LoRAChecker(args.lora_config(), self.model_config)
        self.pooler_config = None
        if self.runner == "pooling":  # the same resolution as the cores' (LLMEngine's)
            import os

            from pagedserve.pooling_params import PoolerConfig

            path = getattr(self.source, "path", None)
            self.pooler_config = PoolerConfig.resolve(
                args.pooler_config, path if path is not None and os.path.isdir(path) else None)
        self.processor = Processor(self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.router = Router(self.client.num_engines, args.data_parallel_routing,
                             ready.block_size, args.data_parallel_load_threshold,
                             loras_per_engine=args.max_cpu_loras or args.max_loras)
        self.in_flight: dict[str, _InFlight] = {}
        self.lost_engines: dict[int, str] = {}
        self.restart_lost_cores = args.data_parallel_restart_lost
        self._lock = threading.RLock()
        self._prev_stats: dict[int, Any] = {}
        self._request_ids = itertools.count()
        self.sleeping = False

    @property
    def num_engines(self) -> int:
        return self.client.num_engines

    @property
    def engine_pids(self) -> list[int | None]:
        return [self.client.pid(i) for i in range(self.num_engines)]

    def new_request_id(self) -> str:
        return str(next(self._request_ids))

    def tokenize(self, prompt: str) -> list[int]:
        return self.processor.tokenize(prompt)

    # --- requests ------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: str | None, params: SamplingParams | PoolingParams,
               prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
               priority: int = 0, lora_request=None) -> int:
        """Tokenize, route and send one request; returns its core. ValueError for what the
        front end can tell at once (the core's refusal comes later as a `Handled` error)."""
        if request_id in self.outputs.requests or request_id in self.in_flight:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        ids = self.processor.prompt_ids(prompt, prompt_token_ids)
        lora_request = self.lora.check(lora_request)
        request = self.processor.make_request(request_id, ids, params, arrival_time, priority,
                                              lora_request)
        with self._lock:
            core = self._route(request)
            self.outputs.add(request_id, prompt, ids,
                             None if isinstance(params, PoolingParams) else params,
                             request.arrival_time, core)
            self.in_flight[request_id] = _InFlight(core, request, len(ids), len(ids))
            self.router.add_load(core, len(ids))
            self.client.send(core, request)
        return core

    def _route(self, request: CoreRequest, exclude=frozenset()) -> int:
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        params = request.sampling_params or request.pooling_params
        salt = getattr(params, "cache_salt", None)
        try:
            return self.router.choose(request.prompt_token_ids, lora, salt, exclude)
        except RuntimeError:
            raise EngineCoreDiedError("every engine core is lost: "
                                      + "; ".join(f"engine {i}: {r}" for i, r in
                                                  sorted(self.lost_engines.items()))) from None

    def abort(self, request_id: str) -> bool:
        """Forget a request here and stop it in its core. False when unknown."""
        with self._lock:
            flight = self.in_flight.pop(request_id, None)
            self.outputs.forget(request_id)
            if flight is None:
                return False
            self.router.add_load(flight.core, -flight.load)
            self.client.send(flight.core, CoreAbort([request_id]))
            return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.in_flight)

    # --- messages from the cores ------------------------------------------------------------------

    def handle(self, msg) -> Handled:
        """Apply one message from the receive queue (see `Handled`)."""
        with self._lock:
            if isinstance(msg, CoreDied):
                return self._core_died(msg)
            if isinstance(msg, CoreReady):  # a restarted core is back
                self.lost_engines.pop(msg.engine_index, None)
                self.router.mark_alive(msg.engine_index)
                logger.info("engine core %d is back", msg.engine_index)
                return Handled(engine_index=msg.engine_index)
            return self._outputs(msg)

    def _outputs(self, msg: CoreOutputs) -> Handled:
        core = msg.engine_index
        done = Handled(engine_index=core)
        if msg.kv_events is not None:
            self.router.apply_events(core, msg.kv_events)
        for request_id in msg.accepted:
            flight = self.in_flight.get(request_id)
            if flight is not None and flight.core == core:
                flight.accepted = True
                done.accepted.append(request_id)
        for request_id, message in msg.refused:
            if self._drop(request_id, core):
                done.errors.append((request_id, ValueError(message)))
        for request_id, message in msg.failed:
            if self._drop(request_id, core):
                from pagedserve.engine.request_stream import EngineStepError

                done.errors.append((request_id, EngineStepError(message)))
        for delta in msg.deltas:
            flight = self.in_flight.get(delta.request_id)
            if flight is None or flight.core != core:
                continue
            state = self.outputs.requests.get(delta.request_id)
            before = state.num_generated if state is not None else 0
            out, stopped, abort = self.outputs.process(delta)
            if out is None:
                continue
            flight.request = None  # it produced something: never routed again
            grown = (state.num_generated if state is not None else 0) - before
            if grown:
                flight.load += grown
                self.router.add_load(core, grown)
            if stopped and not abort and not out.finished:
                self.client.send(core, CoreStopSeqs([(delta.request_id, i) for i in stopped]))
            if out.finished:
                self.in_flight.pop(delta.request_id, None)
                self.router.add_load(core, -flight.load)
                if abort:
                    self.client.send(core, CoreAbort([delta.request_id]))
            done.outputs.append(out)
        if msg.stats is not None:
            done.stats = self._step_stats(core, msg.stats)
        return done

    def _drop(self, request_id: str, core: int) -> bool:
        flight = self.in_flight.get(request_id)
        if flight is None or flight.core != core:
            return False
        del self.in_flight[request_id]
        self.outputs.forget(request_id)
        self.router.add_load(core, -flight.load)
        return True

    def _core_died(self, died: CoreDied) -> Handled:
        core = died.engine_index
        self.lost_engines[core] = died.reason
        self.router.mark_dead(core)
        done = Handled(engine_index=core, died=died)
        lost = [(rid, f) for rid, f in self.in_flight.items() if f.core == core]
        for request_id, flight in lost:
            if flight.request is not None and any(self.router.alive):
                # NOTE: nothing of it reached the caller: it runs again from the start elsewhere
                # (the same tokens: sampling is seeded per request, or fresh draws nobody saw).
                target = self._route(flight.request)
                flight.core = target
                flight.accepted = False
                state = self.outputs.requests.get(request_id)
                if state is not None:
                    state.engine_index = target
                self.router.add_load(target, flight.load)
                self.client.send(target, flight.request)
                logger.warning("request %s moved from lost engine core %d to core %d",
                               request_id, core, target)
                continue
            del self.in_flight[request_id]
            self.outputs.forget(request_id)
            done.errors.append((request_id, EngineCoreDiedError(
                f"engine core {core} died ({died.reason}); the request was running there and "
                "is lost")))
        if self.restart_lost_cores and self.client.backend == "mp":
            logger.warning("restarting engine core %d", core)
            self.client.restart(core)
        return done

    def _step_stats(self, core: int, s) -> StepStats:
        prev = self._prev_stats.get(core)
        self._prev_stats[core] = s

        def grew(name):
            return getattr(s, name) - (getattr(prev, name) if prev is not None else 0)

        modes = {m: c - (prev.preemptions_by_mode.get(m, 0) if prev is not None else 0)
                 for m, c in s.preemptions_by_mode.items()}
        stats = StepStats(
            now=time.monotonic(), num_running=s.num_running, num_waiting=s.num_waiting,
            kv_usage=s.kv_usage, num_used_blocks=s.num_used_blocks, num_blocks=s.num_blocks,
            num_swapped=s.num_swapped, cpu_kv_usage=s.cpu_kv_usage, preemptions_by_mode=modes,
            steps=grew("steps"), prompt_tokens=grew("prompt_tokens"),
            generation_tokens=grew("generation_tokens"), preemptions=grew("preemptions"),
            prefix_cache_queries=grew("prefix_queries"), prefix_cache_hits=grew("prefix_hits"),
            engine=core)
        return stats

    def core_totals(self) -> dict[int, Any]:
        """Each core's latest cumulative counters (`CoreStats`), by engine index."""
        return dict(self._prev_stats)

    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found cached / looked up, over every core so far."""
        totals = self._prev_stats.values()
        queries = sum(s.prefix_queries for s in totals)
        return sum(s.prefix_hits for s in totals) / queries if queries else 0.0

    def shutdown(self) -> None:
        self.client.shutdown()

    def check_health(self) -> None:
        """Raise `EngineCoreDiedError` when every core is lost."""
        if not any(self.client.alive):
            raise EngineCoreDiedError("every engine core is lost")


class MPLLMEngine(FrontEnd):
    """The synchronous engine over out-of-process cores: what `LLM` drives (`add_request`,
    `step`, `abort_request`, ...), as it drives an `LLMEngine`.

    `step()` waits for the next outputs of any core. A core's refusal of a request raises its
    ValueError from `step` (LLM aborts the batch); a request lost with a dead core raises
    `EngineCoreDiedError` (requests that had produced nothing move to another core)."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self._validate_ids = itertools.count()
        self._pending: list = []  # messages read while waiting for a validation

    # `LLM`'s validation before adding anything: the first core validates without queueing
    def _validate_prompt(self, ids) -> list[int]:
        from pagedserve.engine.llm_engine import LLMEngine

        return LLMEngine._validate_prompt(self, ids)

    def _validate_params(self, params, prompt_len: int):
        """The core's check of a request of `prompt_len` tokens (ValueError), nothing queued."""
        self.validate([0] * prompt_len, params)
        return params

    def _validate_pooling(self, prompt_len: int):
        self.validate([0] * prompt_len, PoolingParams())

    def check_priority(self, priority) -> None:
        from pagedserve.engine.llm_engine import LLMEngine

        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.args.scheduling_policy != "priority":
            LLMEngine.check_priority(SimpleNamespace(scheduler_config=self.args), priority)

    def validate(self, prompt_token_ids: list[int], params, priority: int = 0,
                 lora_request=None) -> None:
        """The core's full check of a request, without queueing it (ValueError)."""
        request_id = f"validate-{next(self._validate_ids)}"
        request = self.processor.make_request(request_id, list(prompt_token_ids), params,
                                              priority=priority, lora_request=lora_request,
                                              validate_only=True)
        core = next(i for i in range(self.num_engines) if self.client.alive[i])
        self.client.send(core, request)
        while True:
            msg = self.client.messages.get()
            if isinstance(msg, CoreOutputs) and (
                    request_id in msg.accepted or any(r == request_id for r, _ in msg.refused)):
                for rid, message in msg.refused:
                    if rid == request_id:
                        raise ValueError(message)
                return
            self._pending.append(msg)

    def add_request(self, request_id: str, prompt: str | None, params,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_request=None):
        self.submit(request_id, prompt, params, prompt_token_ids, arrival_time, priority,
                    lora_request)

    def abort_request(self, request_id: str) -> bool:
        return self.abort(request_id)

    def add_beam_request(self, request_id, prompt, params, prompt_token_ids=None, priority=0,
                         lora_request=None):
        """Queue a beam search (as `LLMEngine.add_beam_request`: the core runs the beams)."""
        from pagedserve.engine.llm_engine import LLMEngine

        return LLMEngine.add_beam_request(self, request_id, prompt, params, prompt_token_ids,
                                          priority, lora_request)

    def step(self) -> list[RequestOutput]:
        if not self.in_flight:
            return []
        import queue as _queue

        msgs = list(self._pending)
        self._pending = []
        if not msgs:
            msgs.append(self.client.messages.get())
        while True:
            try:
                msgs.append(self.client.messages.get_nowait())
            except _queue.Empty:
                break
        outputs = []
        errors: list[tuple[str, Exception]] = []
        for msg in msgs:
            done = self.handle(msg)
            outputs += done.outputs
            errors += done.errors
        if errors:
            raise errors[0][1]
        return outputs
