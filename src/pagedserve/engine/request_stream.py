"""The asyncio side of one request: its `RequestStream` of outputs, and the errors a stream can
end with. The engine thread delivers outputs through `AsyncLLMEngine` (engine/async_engine.py);
only the event loop's thread touches a stream.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from pagedserve.outputs import RequestOutput


class StreamOwner(Protocol):
    """What a stream asks of the engine that made it (`AsyncLLMEngine`)."""

    def _forget(self, request_id: str) -> None:
        """The consumer is done with the request: drop its stream."""

    def _abort(self, request_id: str) -> None:
        """Abort the request (the consumer closed its stream before it finished)."""


class EngineDeadError(RuntimeError):
    """The engine thread crashed; no request can be served any more."""


class EngineStepError(RuntimeError):
    """The model step that computed this request raised; the request was aborted, the engine
    lives on."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and ended (or refused) the request."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting to start; try again later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestStream:
    """The outputs of one request, as an async iterator of `RequestOutput`.

    Each `__anext__` returns the newest output (the engine may have produced several since the
    previous read; the newest holds everything). Iteration ends after the output with
    `finished=True`; an engine failure is raised. `close()` aborts the request if it has not
    finished. Only the event loop's thread may use a stream.
    """

    def __init__(self, request_id: str, owner: StreamOwner, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._finished = False  # the final output arrived from the engine
        self._closed = False  # the consumer will read no more (finished, failed or closed)
        self.started = False  # at least one output arrived (the request is past the queue)
        # --stream-interval: outputs are read once this many more tokens arrived (or at the end);
        # the ones between are skipped, which loses nothing (each output holds everything)
        self.interval = 1
        self._read_tokens = 0
        self.on_finish = None  # called with the final output when it is read (request logging)

    @property
    def finished(self) -> bool:
        return self._finished

    # --- called on the event loop by the engine's deliveries ----------------------------------

    def _accept(self) -> None:
        if not self._accepted.done():
            self._accepted.set_result(None)

    def _put(self, output: RequestOutput) -> None:
        if self._closed and not self._finished and self._error is None:
            return  # closed by the consumer; its abort is on its way to the engine
        self.started = True
        self._latest = output
        if output.finished:
            self._finished = True
            self._owner._forget(self.request_id)
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        """End the stream with `exc` (raised to the reader) unless it already finished."""
        if self._finished or self._error is not None:
            return
        self._owner._forget(self.request_id)
        if not self._accepted.done():
            self._accepted.set_exception(exc)
            self._closed = True
            return
        self._error = exc
        self._event.set()

    # --- the consumer's side ------------------------------------------------------------------

    async def wait_accepted(self) -> None:
        """Return once the engine queued the request; raise its ValueError if it refused it."""
        await self._accepted

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                if self.interval > 1 and not out.finished and isinstance(out.outputs, list):
                    tokens = sum(len(c.token_ids) for c in out.outputs)
                    if tokens - self._read_tokens < self.interval and not any(
                            c.finish_reason for c in out.outputs):
                        continue  # not enough new tokens yet: wait for a newer output
                    self._read_tokens = tokens
                if out.finished and self.on_finish is not None:
                    self.on_finish(out)
                return out
            if self._error is not None:
                err, self._error = self._error, None
                self._closed = True
                raise err
            if self._finished or self._closed:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    def close(self) -> None:
        """Stop reading; abort the request in the engine unless it finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._finished and self._error is None:
            self._owner._abort(self.request_id)
