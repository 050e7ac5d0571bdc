"""`EngineReplica`: one Ray Serve replica = one engine (an `AsyncLLMEngine` over an `LLMEngine`,
its own KV cache), reporting to the app's `CacheIndex`.

`generate(request)` (a streaming method) takes the dict the ingress builds (`request_id`,
`prompt`, `prompt_token_ids`, `params`, `priority`, and the routing fields `cache_salt` /
`lora_id` the request router reads) and yields, in order: ("accepted",) once the engine queued
the request, then its `RequestOutput`s (each holds everything so far), or ("error", kind,
message) in place of either (kind: "value" for a refusal, a 400 at the ingress; "queue_full",
"shutdown", "dead", "step"). Cancelling the call (the client left) aborts the request.

After every engine step (a stats listener, in the engine thread) the replica sends the index the
step's KV cache events (vLLM's msgpack batch), its load (the prompt and output tokens of the
requests it holds) and its cumulative prefix-cache counters (a step without events: at most
every `REPORT_INTERVAL_S`); after each request ends, its load again (no step may follow).
"""

from __future__ import annotations

import logging
import threading
import time

from pagedserve.engine.kv_events import KVEventCollector, encode_batch
from pagedserve.engine.request_stream import (
    EngineDeadError,
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
)

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.05  # the most often a step without KV events reports the replica's load

ERROR_KINDS = ((ValueError, "value"), (QueueFullError, "queue_full"),
               (EngineShutdownError, "shutdown"), (EngineDeadError, "dead"),
               (EngineStepError, "step"))


def error_kind(exc: BaseException) -> str | None:
    for cls, kind in ERROR_KINDS:
        if isinstance(exc, cls):
            return kind
    return None


class _Reporter:
    """The stats listener that feeds the cache index (called in the engine thread)."""

    def __init__(self, replica: EngineReplica) -> None:
        self._replica = replica

    def on_step(self, stats) -> None:
        self._replica._report(from_step=True)

    def on_request_finished(self, stats) -> None:
        pass


class EngineReplica:
    """One engine per replica (see the module docstring). `app_name` names the app's cache index
    actor; `engine_kwargs` are `EngineArgs` fields (as `LLM(model, **kwargs)` takes them)."""

    def __init__(self, model: str, engine_kwargs: dict | None = None,
                 app_name: str = "pagedserve", routing: dict | None = None) -> None:
        from pagedserve.config import EngineArgs
        from pagedserve.engine.async_engine import AsyncLLMEngine
        from pagedserve.engine.llm_engine import LLMEngine
        from pagedserve.entrypoints.ray_serve.actors import cache_index_actor

        kwargs = dict(engine_kwargs or {})
        for name in ("data_parallel_size", "engine_core_process"):
            if kwargs.get(name) not in (None, 1, False):
                raise ValueError(f"engine_kwargs: {name} does not apply to a Ray Serve replica "
                                 "(scale with num_replicas / autoscaling_config)")
        self.engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=model, **kwargs)),
                                     listeners=[_Reporter(self)])
        llm = self.engine.engine
        self._events = KVEventCollector(llm.kv_manager.block_size)
        llm.kv_manager.events = self._events
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # outside Serve (a unit test)
            self.replica_id = f"local-{id(self)}"
        self._index = cache_index_actor(app_name, **(routing or {}))
        wanted = (routing or {}).get("block_size")
        if wanted is not None and wanted != llm.kv_manager.block_size:
            logger.warning("the cache index keys blocks of %d tokens, this engine's are %d: "
                           "prefix routing will find nothing", wanted, llm.kv_manager.block_size)
        self._load = 0  # tokens of the requests this replica holds (event loop writes)
        self._report_lock = threading.Lock()
        self._last_report = 0.0

    def _report(self, from_step: bool = False) -> None:
        kv = self.engine.engine.kv_manager
        with self._report_lock:  # NOTE: the engine thread and the event loop both report
            batch = self._events.take() if from_step else None
            now = time.monotonic()
            # NOTE: a step without events reports its load at most every REPORT_INTERVAL_S (a
            # remote call per decode step would cost the engine thread); a request's end always
            # reports (from the event loop), so an idle replica's load reads 0.
            if batch is None and from_step and now - self._last_report < REPORT_INTERVAL_S:
                return
            self._last_report = now
            self._index.report.remote(
                self.replica_id, None if batch is None else encode_batch(batch), self._load,
                getattr(kv, "prefix_hits", 0), getattr(kv, "prefix_queries", 0))

    def info(self) -> dict:
        """What the ingress needs to know of the engine (and, for checks, its KV blocks in use
        and requests held)."""
        llm = self.engine.engine
        return {"max_model_len": llm.max_model_len, "vocab_size": llm.vocab_size,
                "block_size": llm.kv_manager.block_size, "replica_id": self.replica_id,
                "num_used_blocks": llm.num_used_blocks(), "load": self._load}

    async def generate(self, request: dict):
        """Stream one request's outputs (see the module docstring)."""
        if not self.engine.started:
            self.engine.start()
        ids = request["prompt_token_ids"]
        try:
            stream = await self.engine.add_request(
                request["request_id"], request.get("prompt"), request["params"],
                prompt_token_ids=ids, priority=request.get("priority", 0))
        except Exception as e:
            kind = error_kind(e)
            if kind is None:
                raise
            yield ("error", kind, str(e))
            return
        held = len(ids)
        self._load += held
        # NOTE: from here on the request runs in the engine: a cancel at any yield (the accepted
        # mark too) must reach `finally`, which aborts it.
        try:
            yield ("accepted",)
            async for out in stream:
                grown = len(ids) + sum(len(c.token_ids) for c in out.outputs)
                self._load += grown - held
                held = grown
                yield out
        except Exception as e:
            kind = error_kind(e)
            if kind is None:
                raise
            yield ("error", kind, str(e))
        finally:
            stream.close()
            self._load -= held
            self._report()

    async def __del__(self) -> None:
        """Serve stops the replica (scaled down, redeployed, shut down): its blocks leave the
        index at once, its engine stops."""
        index = getattr(self, "_index", None)
        if index is not None:
            index.remove_replica.remote(self.replica_id)
        engine = getattr(self, "engine", None)
        if engine is not None and engine.started:
            await engine.shutdown(timeout=10.0)

    def check_health(self) -> None:
        """Serve's health check: a dead engine fails it (Serve replaces the replica)."""
        if self.engine.errored:
            raise RuntimeError(f"the engine has stopped after an error: {self.engine._dead!r}")
