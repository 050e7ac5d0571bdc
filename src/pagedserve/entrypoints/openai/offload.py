"""`CPUPool`: the thread that does a request's CPU work off the event loop.

Tokenizing a long prompt, rendering a chat template, decoding and serialising a large response
(full-vocabulary logprobs) take from milliseconds to seconds; on the event loop they would stall
every other request, `/health` included. The handlers hand that work to this pool instead.

NOTE: one worker by default. HF fast tokenizers are Rust objects behind a `RefCell`: calls that
change their truncation / padding state from two threads at once raise "Already borrowed", and
on a CPU-bound server more tokenizer threads only contend with the engine thread for cores. The
Rust tokenizer releases the GIL while it encodes, so the loop keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

R = TypeVar("R")


class CPUPool:
    """Runs blocking functions on its worker thread(s), awaited from the event loop."""

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="pagedserve-cpu")

    async def run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)` on the pool; its result or its exception."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Stop the worker(s) once queued work is done (without waiting for it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def json_response(model: Any, status: int = 200, headers: dict[str, str] | None = None):
    """A JSON `Response` of a pydantic model (serialised where it is called: call it on the
    pool for large bodies)."""
    from fastapi.responses import Response

    return Response(model.model_dump_json(), status_code=status, media_type="application/json",
                    headers=headers)
