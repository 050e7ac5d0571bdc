"""`StreamHost`: the event-loop side that `AsyncLLMEngine` (one engine on a thread,
engine/async_engine.py) and `AsyncMPEngine` (engine cores in their own processes,
engine/async_mp_engine.py) share: the request streams, the admission checks, the state the
server reads (`accepting`, `errored`, `num_queued`, ...), listeners, `generate` and `abort`.

A subclass calls `_init_streams` in its constructor and brings `start` (its thread),
`add_request` (opening the stream with `_open_stream`), `shutdown`, and `_abort_in_core` (how
a request leaves the engine).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterable

from pagedserve.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
    RequestStream,
)
from pagedserve.engine.stats import StatsListener
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class StreamHost:
    """The streams of the requests in flight and the engine's state as the event loop sees it.

    NOTE: `_streams` is touched on the event loop's thread only (as every `RequestStream`);
    the subclass's thread hands outputs over with `loop.call_soon_threadsafe`.
    """

    def _init_streams(self, max_queued_requests: int | None,
                      listeners: Iterable[StatsListener]) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        self._listeners: list[StatsListener] = list(listeners)
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._death_listeners: list = []
        self._closing = False

    # --- state --------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def accepting(self) -> bool:
        """True while new requests are accepted (started, not shutting down, not crashed)."""
        return self.is_running and not self._closing

    @property
    def errored(self) -> bool:
        """True once the engine died."""
        return self._dead is not None

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished."""
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests added that have not produced any output yet."""
        return sum(1 for s in self._streams.values() if not s.started)

    def add_listener(self, listener: StatsListener) -> None:
        """Receive step and request records (call before `start`)."""
        if self._thread is not None:
            raise RuntimeError("add listeners before the engine starts")
        self._listeners.append(listener)

    def add_death_listener(self, callback) -> None:
        """Call `callback(error)` on the event loop once the engine has died."""
        self._death_listeners.append(callback)

    # --- lifecycle ----------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """Refuse new requests (`EngineShutdownError`) and let those in flight finish (a
        graceful drain; `begin_shutdown` ends them). Call on the event loop."""
        self._closing = True

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and end every request in flight with `EngineShutdownError`.
        Call on the event loop."""
        self._closing = True
        for stream in list(self._streams.values()):
            stream._fail(EngineShutdownError(reason))
            self._abort_in_core(stream.request_id)

    async def __aenter__(self):
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # --- requests -----------------------------------------------------------------------------

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    def _open_stream(self, request_id: str) -> RequestStream:
        """The new request's stream, registered, after the admission checks: ValueError for an
        id in flight, QueueFullError past `max_queued_requests`, EngineShutdownError while
        shutting down, EngineDeadError after a crash."""
        if self._loop is None:
            raise RuntimeError("start() the engine first")
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped after an error: {self._dead!r}")
        if self._closing:
            raise EngineShutdownError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if self.max_queued_requests is not None and self.num_queued >= self.max_queued_requests:
            raise QueueFullError(
                f"the server has {self.num_queued} requests waiting (max_queued_requests="
                f"{self.max_queued_requests}); retry later")
        stream = RequestStream(request_id, self, self._loop)
        self._streams[request_id] = stream
        return stream

    async def generate(self, prompt: str | None, params: SamplingParams,
                       request_id: str | None = None, *,
                       prompt_token_ids: list[int] | None = None, priority: int = 0,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes (see `add_request` for errors).
        Leaving the loop early or cancelling the task aborts the request."""
        stream = await self.add_request(request_id or self.new_request_id(), prompt, params,
                                        prompt_token_ids, priority=priority,
                                        lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it is unknown or finished). Call on the event loop."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()

    def _abort(self, request_id: str) -> None:
        """(`StreamOwner`) the consumer closed its stream before the request finished."""
        self._streams.pop(request_id, None)
        self._abort_in_core(request_id)

    def _forget(self, request_id: str) -> None:
        """(`StreamOwner`) the consumer is done with a finished request."""
        self._streams.pop(request_id, None)

    def _abort_in_core(self, request_id: str) -> None:
        """End the request where the engine holds it (from the event loop's thread)."""
        raise NotImplementedError(f"{type(self).__name__} must say how a request is aborted")
