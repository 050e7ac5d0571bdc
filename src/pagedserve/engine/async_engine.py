"""`AsyncLLMEngine`: an `LLMEngine` stepping in one background thread, fed from asyncio.

- The engine is touched only from its thread. Adds and aborts enter through a thread-safe queue
  and are applied between steps, so every request that arrived during a step joins the next one
  (continuous batching across concurrent callers).
- While nothing is in flight the thread blocks on that queue (no busy loop).
- Each request has its own `RequestStream`; the engine thread hands outputs to the event loop
  with `loop.call_soon_threadsafe`. A stream keeps only the newest output: `RequestOutput` holds
  the full text, token ids and logprobs so far, so a slow reader skips nothing by reading only
  the newest one, and never reads more than one output per step.
- Closing a stream (a cancelled task, a client gone) aborts its request before the next step,
  freeing its KV blocks.
- If a step raises, the requests that step scheduled (or preempted) are aborted, their blocks
  freed, and their streams fail with `EngineStepError` (a 500); the engine logs the traceback
  and keeps stepping for everyone else. A failure that cannot be pinned on any request, twice in
  a row, or any error outside the step, is fatal: every request in flight fails with
  `EngineDeadError` and new ones are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.request_records import finished_record, note_tokens
from pagedserve.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from pagedserve.engine.stats import (
    FinishedRequestStats,
    StatsListener,
    StatsLogLine,
    StepStats,
)
from pagedserve.engine.stream_host import StreamHost
from pagedserve.kernels.openmp import release_thread_pool
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.executor import WorkerDiedError

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineShutdownError",
    "EngineStepError",
    "QueueFullError",
    "RequestStream",
]


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_request: object | None = None  # lora.request.LoRARequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result or error goes to
    `future` (see `AsyncLLMEngine.call_in_engine_thread`)."""

    fn: object
    future: asyncio.Future


_STOP = object()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request in flight."""

    stream: RequestStream
    arrival_time: float
    last_token_time: float | None = None
    num_tokens: int = 0
    params: SamplingParams | None = None


class AsyncLLMEngine(StreamHost):
    """Serve many concurrent asyncio callers with one `LLMEngine` (see the module docstring).

    Use `start()` from inside the event loop (or `async with`), then `generate()` /
    `add_request()`; `shutdown()` ends in-flight requests with `EngineShutdownError` and stops
    the thread. `listeners` receive step and request records in the engine thread (metrics);
    `log_stats_interval` (seconds) logs a stats line periodically while busy.
    """

    @classmethod
    def from_engine_args(cls, engine_args, **kwargs) -> AsyncLLMEngine:
        """vLLM's constructor: an engine built from `engine_args` (`EngineArgs` or
        `AsyncEngineArgs`); `kwargs` as `__init__`'s. Start it with `start()` (the server's
        lifespan does), or let the first request's `add_request` start it."""
        from pagedserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine(engine_args), **kwargs)

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queued_requests: int | None = None,
        log_stats_interval: float | None = None,
        listeners: Iterable[StatsListener] = (),
    ) -> None:
        self._init_streams(max_queued_requests, listeners)
        self.engine = engine
        self._log_line = StatsLogLine(log_stats_interval) if log_stats_interval else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Engine-thread side: requests the engine holds.
        self._tracked: dict[str, _Tracked] = {}
        self._prev_modes: dict[str, int] = {}
        # Consecutive failed steps that scheduled no request (2 are fatal; see _step).
        self._unpinned_failures = 0
        # Engine-thread side: while paused (vLLM's /pause), requests are added and aborted but
        # not stepped.
        self._paused = False
        self._prev_totals = self._engine_totals()

    # --- state --------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """The engine's tokenizer (encoding is safe from the event loop's thread)."""
        return self.engine.tokenizer

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will use the engine."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        # NOTE: the model was loaded on this thread: free this thread's OpenMP workers, or the
        # engine thread's parallel regions pay a wake-up each (see kernels/openmp.py).
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()
        executor = getattr(self.engine, "executor", None)
        if executor is not None:
            # A worker found dead while the engine is idle fails the engine at once, too.
            executor.add_failure_listener(self._die)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """`begin_shutdown`, then stop and join the engine thread."""
        self.begin_shutdown()
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._inbox.put(_STOP)
        await asyncio.to_thread(thread.join, timeout)
        if thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)

    # --- requests -----------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request; return its stream once the engine accepted it.

        Raises ValueError (the engine's validation, naming the problem), QueueFullError past
        `max_queued_requests`, EngineShutdownError while shutting down, EngineDeadError after a
        crash. Cancelling the caller while it waits aborts the request.
        """
        stream = self._open_stream(request_id)
        self._inbox.put(_Add(
            stream, prompt, None if prompt_token_ids is None else list(prompt_token_ids), params,
            time.monotonic() if arrival_time is None else arrival_time, priority, lora_request,
        ))
        try:
            await stream.wait_accepted()
        except BaseException:
            stream.close()
            raise
        return stream

    async def call_in_engine_thread(self, fn, timeout: float | None = 60.0):
        """`fn(llm_engine)` run on the engine thread between two steps (the only thread that may
        touch the `LLMEngine`); returns its result or raises its exception (`TimeoutError`
        after `timeout` seconds, e.g. if the engine thread dies first). For debugging and
        tests, e.g. `check_invariants`."""
        if self._loop is None:
            raise RuntimeError("start() the engine first")
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running")
        future = self._loop.create_future()
        self._inbox.put(_Call(fn, future))
        return await asyncio.wait_for(future, timeout)

    # --- operations (vLLM's /pause, /resume, /abort_requests) ---------------------------------

    async def pause(self) -> None:
        """Stop stepping: requests in flight stay where they are (their blocks held), new ones
        are queued; `resume` goes on. Aborts and calls are still served."""
        await self.call_in_engine_thread(lambda _: setattr(self, "_paused", True))

    async def resume(self) -> None:
        await self.call_in_engine_thread(lambda _: setattr(self, "_paused", False))

    @property
    def paused(self) -> bool:
        return self._paused

    async def abort_requests(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """End requests in flight from outside (not by their reader): each gets a final output
        whose finish_reason is "abort", its blocks freed; None: every request. Unknown or
        finished ids are skipped; returns the ids aborted."""
        wanted = None if request_ids is None else list(request_ids)

        def abort(engine: LLMEngine) -> list[str]:
            ids = list(self._tracked) if wanted is None else [
                r for r in wanted if r in self._tracked]
            outputs = []
            for request_id in ids:
                group = engine.groups.get(request_id)
                if group is not None and engine.abort_request(request_id):
                    outputs.append(engine._make_output(group, True))
            self._report(outputs)  # delivers them, records each finished request
            return [out.request_id for out in outputs]

        return await self.call_in_engine_thread(abort)

    def _abort_in_core(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                stop = False
                for cmd in commands:
                    if cmd is _STOP:
                        stop = True
                    else:
                        self._apply(cmd)
                if stop:
                    for request_id in list(self._tracked):
                        self._apply(_Abort(request_id))
                    self._report([])
                    return
                if self.engine.has_unfinished_requests() and not self._paused:
                    self._report(self._step())
                elif commands:
                    self._report([])  # e.g. aborts freed blocks: publish the new state
                elif self._log_line is not None:
                    self._log_line.log_if_due(time.monotonic())
        except BaseException as exc:
            logger.exception("the engine loop crashed; failing every request in flight")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead (from any thread): fail every request in flight, refuse new
        ones, and tell the death listeners (the server exits non-zero)."""
        if self._dead is not None:
            return
        self._dead = exc
        self._call_in_loop(self._fail_all, EngineDeadError(f"the engine crashed: {exc!r}"))
        for listener in self._death_listeners:
            self._call_in_loop(listener, exc)

    def _step(self) -> list[RequestOutput]:
        """`engine.step()`, surviving a step that raises: its requests are aborted (freeing their
        blocks) and fail with `EngineStepError`, and no output is returned. Re-raises (killing
        the engine) when the failure touched no request for the second step in a row: the fault
        is not the requests', so stepping on would only spin."""
        try:
            outputs = self.engine.step()
        except WorkerDiedError:
            raise  # a dead worker never comes back: the engine is dead, not the requests
        except Exception as exc:
            blamed = [r for r in self.engine.step_request_ids() if r in self._tracked]
            if not blamed:
                self._unpinned_failures += 1
                if self._unpinned_failures >= 2:
                    raise
                logger.exception("a model step failed before scheduling any request; retrying")
                return []
            self._unpinned_failures = 0
            logger.exception("a model step failed; aborting its %d request(s): %s",
                             len(blamed), ", ".join(blamed))
            error = EngineStepError(f"the model step computing this request failed: {exc!r}")
            for request_id in blamed:
                stream = self._tracked[request_id].stream
                self._apply(_Abort(request_id))  # frees its blocks, records an "abort"
                self._call_in_loop(stream._fail, error)
            return []
        self._unpinned_failures = 0
        return outputs

    def _next_commands(self) -> list:
        """Everything queued; when idle, block until something arrives (or a log line is due)."""
        commands = []
        if self._paused or not self.engine.has_unfinished_requests():
            timeout = None
            deadline = self._log_line.next_deadline() if self._log_line else None
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
            try:
                commands.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            stream = cmd.stream
            try:
                self.engine.add_request(
                    stream.request_id, cmd.prompt, cmd.params,
                    prompt_token_ids=cmd.prompt_token_ids, arrival_time=cmd.arrival_time,
                    priority=cmd.priority, lora_request=cmd.lora_request,
                )
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    logger.exception("adding request %s failed", stream.request_id)
                self._call_in_loop(stream._fail, exc)
                return
            self._tracked[stream.request_id] = _Tracked(stream, cmd.arrival_time,
                                                        params=cmd.params)
            self._call_in_loop(stream._accept)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's
                self._call_in_loop(_settle, cmd.future, None, exc)
            else:
                self._call_in_loop(_settle, cmd.future, result, None)
        elif isinstance(cmd, _Abort):
            tracked = self._tracked.pop(cmd.request_id, None)
            if tracked is None:
                return
            group = self.engine.groups.get(cmd.request_id)
            self.engine.abort_request(cmd.request_id)
            now = time.monotonic()
            record = FinishedRequestStats(
                request_id=cmd.request_id, finish_reason="abort",
                prompt_tokens=len(group.prompt_token_ids) if group else 0,
                generation_tokens=tracked.num_tokens,
                e2e_latency=now - tracked.arrival_time,
                queue_time=(group.first_scheduled_time - tracked.arrival_time)
                if group is not None and group.first_scheduled_time is not None else None,
            )
            for listener in self._listeners:
                listener.on_request_finished(record)

    def _report(self, outputs: list[RequestOutput]) -> None:
        """Deliver a step's outputs to their streams and publish the step's records."""
        now = time.monotonic()
        ttft, itl, deliveries, finished = [], [], [], []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            note_tokens(tracked, out, now, ttft, itl)
            deliveries.append((tracked.stream, out))
            if out.finished:
                del self._tracked[out.request_id]
                finished.append(finished_record(out, tracked, now))
        totals = self._engine_totals()
        delta = [a - b for a, b in zip(totals, self._prev_totals)]
        self._prev_totals = totals
        info = self.engine.last_schedule_info()
        kv = self.engine.kv_manager
        modes = info.get("preemptions_by_mode", {})
        mode_delta = {m: c - self._prev_modes.get(m, 0) for m, c in modes.items()}
        self._prev_modes = modes
        stats = StepStats(
            now=now, num_running=info.get("running", 0), num_waiting=info.get("waiting", 0),
            num_swapped=info.get("swapped", 0), kv_usage=info.get("kv_usage", kv.usage()),
            num_used_blocks=self.engine.num_used_blocks(), num_blocks=kv.num_blocks,
            steps=delta[0], prompt_tokens=delta[1], generation_tokens=delta[2],
            preemptions=delta[3], prefix_cache_queries=delta[4], prefix_cache_hits=delta[5],
            time_to_first_token=ttft, inter_token_latency=itl,
            cpu_kv_usage=info.get("cpu_kv_usage", 0.0), preemptions_by_mode=mode_delta,
            spec_totals=self.engine.spec.totals() if self.engine.spec is not None else None,
            kv_groups=info.get("kv_groups", []),
        )
        for listener in self._listeners:
            listener.on_step(stats)
            for record in finished:
                listener.on_request_finished(record)
        if self._log_line is not None:
            self._log_line.on_step(stats)
        # NOTE: after the listeners, so that a caller holding an output sees metrics that
        # already count it.
        if deliveries:
            self._call_in_loop(self._deliver, deliveries)

    def _engine_totals(self) -> tuple[int, ...]:
        """Cumulative counters: steps, prompt and generation tokens, preemptions, prefix-cache
        queries and hits (tokens; 0 without prefix caching)."""
        s, kv = self.engine.stats, self.engine.kv_manager
        return (s["steps"], s["prompt_tokens"], s["generation_tokens"],
                self.engine.scheduler.num_preemptions, getattr(kv, "prefix_queries", 0),
                getattr(kv, "prefix_hits", 0))

    def _call_in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed in between
            pass

    # --- event-loop side of deliveries --------------------------------------------------------

    @staticmethod
    def _deliver(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
        for stream, out in deliveries:
            stream._put(out)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._fail(exc)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
