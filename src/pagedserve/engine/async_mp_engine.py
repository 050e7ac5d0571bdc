"""`AsyncMPEngine`: the server's engine when the engine cores run in their own processes
(`--data-parallel-size N`, `--engine-core-process`): the same calls as `AsyncLLMEngine`
(`start`, `add_request`, `generate`, `abort`, `shutdown`, listeners), over a `FrontEnd`.

The event loop tokenizes (the serving layer) and routes: `add_request` sends the request to its
core and waits for the core to accept it (a refusal raises its ValueError, a 400). One output
thread reads the cores' messages, detokenizes and checks stop strings (the output processor),
and hands each request's newest output to its stream on the event loop: the model's process
does no text work at all. A request that ends with its core fails with `EngineCoreDiedError`
(naming the engine); when no core is left the engine is dead (`errored`, the death listeners:
the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.engine.core_client import EngineCoreDiedError
from pagedserve.engine.mp_engine import FrontEnd
from pagedserve.engine.request_records import finished_record, note_tokens
from pagedserve.engine.request_stream import EngineDeadError, RequestStream
from pagedserve.engine.stats import FinishedRequestStats, StatsListener, StatsLogLine
from pagedserve.engine.stream_host import StreamHost

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    stream: RequestStream
    arrival_time: float
    params: object
    last_token_time: float | None = None
    num_tokens: int = 0
    engine: int = 0


class _CoreProxy:
    """What `call_in_engine_thread(fn)` hands `fn`: the front end's attributes, and the calls the
    cores answer by name (adapters, invariants), made on every live core."""

    def __init__(self, front: FrontEnd) -> None:
        self._front = front

    def __getattr__(self, name):
        return getattr(self._front, name)

    def check_invariants(self) -> None:
        self._front.client.call_all("check_invariants")

    def add_lora(self, request) -> bool:
        self._front.lora.check(request)
        return all(self._front.client.call_all(
            "add_lora", request.lora_name, request.lora_int_id, request.lora_path,
            request.base_model_name))

    def remove_lora(self, lora_int_id: int) -> bool:
        self._front.lora.known.pop(lora_int_id, None)
        return any(self._front.client.call_all("remove_lora", lora_int_id))

    def list_loras(self) -> set[int]:
        return set().union(*map(set, self._front.client.call_all("list_loras")))

    def reset_prefix_cache(self) -> bool:
        return all(self._front.client.call_all("reset_prefix_cache"))

    def engine_states(self) -> list[dict]:
        return self._front.client.call_all("engine_state")


_STOP = object()


class AsyncMPEngine(StreamHost):
    """See the module docstring. `owns_front`: `shutdown` also stops the engine cores."""

    def __init__(self, front: FrontEnd, *, max_queued_requests: int | None = None,
                 log_stats_interval: float | None = None,
                 listeners: Iterable[StatsListener] = (), owns_front: bool = True) -> None:
        self._init_streams(max_queued_requests, listeners)
        self.front = front
        self.owns_front = owns_front  # shutdown() stops the cores too
        self._log_line = StatsLogLine(log_stats_interval) if log_stats_interval else None
        self._tracked: dict[str, _Tracked] = {}
        self._tracked_lock = threading.Lock()

    # --- state ---------------------------------------------------------------------------------

    @property
    def engine(self) -> FrontEnd:
        """The front end (the `LLMEngine` attributes the server reads: source, sizes, args)."""
        return self.front

    @property
    def tokenizer(self):
        return self.front.tokenizer

    @property
    def lost_engines(self) -> dict[int, str]:
        """Engine cores that died (index -> why); the server's /health reports them."""
        return dict(self.front.lost_engines)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-outputs", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.begin_shutdown()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self.front.client.messages.put(_STOP)
            await asyncio.to_thread(thread.join, timeout)
        if self.owns_front:
            await asyncio.to_thread(self.front.shutdown)

    # --- requests ------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | None, params,
                          prompt_token_ids: list[int] | None = None,
                          arrival_time: float | None = None, priority: int = 0,
                          lora_request=None) -> RequestStream:
        """As `AsyncLLMEngine.add_request`: the stream once a core accepted the request."""
        stream = self._open_stream(request_id)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        with self._tracked_lock:
            self._tracked[request_id] = _Tracked(stream, arrival, params)
        try:
            core = self.front.submit(request_id, prompt, params, prompt_token_ids, arrival,
                                     priority, lora_request)
            self._tracked[request_id].engine = core
            await stream.wait_accepted()
        except BaseException:
            with self._tracked_lock:
                self._tracked.pop(request_id, None)
            self._streams.pop(request_id, None)
            stream.close()
            raise
        return stream

    async def call_in_engine_thread(self, fn, timeout: float | None = 60.0):
        """`fn(proxy)`: the front end's attributes and the cores' named calls (adapters,
        invariants, prefix cache; see `_CoreProxy`), run off the event loop."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        return await asyncio.wait_for(asyncio.to_thread(fn, _CoreProxy(self.front)), timeout)

    def _abort_in_core(self, request_id: str) -> None:
        with self._tracked_lock:
            tracked = self._tracked.pop(request_id, None)
        if self.front.abort(request_id) and tracked is not None:
            now = time.monotonic()
            record = FinishedRequestStats(
                request_id=request_id, finish_reason="abort", prompt_tokens=0,
                generation_tokens=tracked.num_tokens, e2e_latency=now - tracked.arrival_time,
                queue_time=None, engine=tracked.engine)
            for listener in self._listeners:
                listener.on_request_finished(record)

    # --- the output thread ----------------------------------------------------------------------

    def _run(self) -> None:
        messages = self.front.client.messages
        try:
            while True:
                timeout = None
                if self._log_line is not None:
                    deadline = self._log_line.next_deadline()
                    if deadline is not None:
                        timeout = max(0.05, deadline - time.monotonic())
                try:
                    msg = messages.get(timeout=timeout)
                except queue.Empty:
                    self._log_line.log_if_due(time.monotonic())
                    continue
                if msg is _STOP:
                    return
                self._handle(msg)
        except BaseException as exc:  # noqa: BLE001 - reported to every request
            logger.exception("the front end's output loop crashed")
            self._die(exc)

    def _handle(self, msg) -> None:
        done = self.front.handle(msg)
        calls = []
        now = time.monotonic()
        ttft, itl, finished = [], [], []
        with self._tracked_lock:
            for request_id in done.accepted:
                tracked = self._tracked.get(request_id)
                if tracked is not None:
                    calls.append((tracked.stream._accept,))
            for request_id, error in done.errors:
                tracked = self._tracked.pop(request_id, None)
                if tracked is not None:
                    calls.append((tracked.stream._fail, error))
            deliveries = []
            for out in done.outputs:
                tracked = self._tracked.get(out.request_id)
                if tracked is None:
                    continue
                note_tokens(tracked, out, now, ttft, itl)
                deliveries.append((tracked.stream, out))
                if out.finished:
                    del self._tracked[out.request_id]
                    finished.append(finished_record(out, tracked, now))
        if done.stats is not None:
            done.stats.time_to_first_token = ttft
            done.stats.inter_token_latency = itl
            for listener in self._listeners:
                listener.on_step(done.stats)
            if self._log_line is not None:
                self._log_line.on_step(done.stats)
        for record in finished:
            for listener in self._listeners:
                listener.on_request_finished(record)
        if deliveries:
            calls.append((self._deliver, deliveries))
        for call in calls:
            self._call_in_loop(*call)
        if done.died is not None and not any(self.front.client.alive) \
                and not self.front.restart_lost_cores:
            self._die(EngineCoreDiedError("every engine core is lost: " + "; ".join(
                f"engine {i}: {r}" for i, r in sorted(self.front.lost_engines.items()))))

    def _die(self, exc: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = exc
        self._call_in_loop(self._fail_all, EngineDeadError(f"the engine crashed: {exc!r}"))
        for listener in self._death_listeners:
            self._call_in_loop(listener, exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._fail(exc)

    @staticmethod
    def _deliver(deliveries) -> None:
        for stream, out in deliveries:
            stream._put(out)

    def _call_in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass
