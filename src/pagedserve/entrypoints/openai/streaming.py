"""Server-sent events: text deltas with hold-back, merging several request streams, SSE lines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel

from pagedserve.engine.async_engine import RequestStream
from pagedserve.outputs import RequestOutput

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class ChoiceState:
    """What one streamed choice has sent so far, and its next text delta.

    NOTE: while the choice is unfinished, the last `holdback` characters of its text are held
    back: the engine cuts a stop string from the text only once it fully matches, so a stream
    that sent a stop string's beginning could not take it back. With holdback =
    max(len(stop)) - 1 (SamplingParams.output_text_buffer_length), the text sent is always a
    prefix of the final, cut text, so the joined deltas equal the non-streamed text. Partial
    UTF-8 characters are already held back by the engine's detokenizer.
    """

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.sent_chars = 0
        self.sent_tokens = 0
        self.text_offset = 0  # logprobs' next text_offset (completions)
        self.started = False  # a chunk was sent
        self.done = False  # the chunk with the finish reason was sent

    def next_text(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - self.holdback
        if end <= self.sent_chars:
            return ""
        delta = text[self.sent_chars:end]
        self.sent_chars = end
        return delta


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (index, output) from several streams as outputs arrive; raise the first error.
    Closing the generator closes every stream (aborting unfinished requests)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    outbox: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                outbox.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            outbox.put_nowait((i, exc))
        finally:
            outbox.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await outbox.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_output(stream: RequestStream) -> RequestOutput:
    """The request's last (finished) output."""
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        stream.close()
    if last is None or not last.finished:
        raise RuntimeError(f"request {stream.request_id} ended without a final output")
    return last
