"""The executors' shared base: `Executor` (what the engine calls every step), the error a dead
worker raises and the driver's communication counters. The backends (worker/executor.py's
`UniExecutor`, worker/mp_executor.py, worker/ray_executor.py, worker/pp_executor.py) build on it;
`worker.executor.make_executor` chooses one."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from pagedserve.core.step_input import StepInput
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.models.base import KVCacheSpec
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.model_runner import MemoryProfile
from pagedserve.worker.worker import CacheConfig, ProfileConfig

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A model worker died or failed: the engine cannot run another step."""


@dataclass
class CommStats:
    """What the driver spent talking to its workers, summed over steps (multi-worker backends).

    `bytes_sent` counts one copy of each step message (what each worker receives);
    `step_seconds` is the driver's wall time per step, `worker_seconds` rank 0's time inside the
    step: the difference is the driver <-> worker overhead (pickling, pipes, waiting)."""

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    step_seconds: float = 0.0
    worker_seconds: float = 0.0

    def reset(self) -> None:
        self.steps = self.bytes_sent = self.bytes_received = 0
        self.step_seconds = self.worker_seconds = 0.0

    def record(self, sent: int, received: int, seconds: float, worker_seconds: float) -> None:
        self.steps += 1
        self.bytes_sent += sent
        self.bytes_received += received
        self.step_seconds += seconds
        self.worker_seconds += worker_seconds

    def line(self) -> str:
        n = max(self.steps, 1)
        return (f"{self.steps} steps: {self.bytes_sent / n:.0f} B sent to each worker and "
                f"{self.bytes_received / n:.0f} B back per step; driver overhead "
                f"{1e3 * (self.step_seconds - self.worker_seconds) / n:.2f} ms per step "
                f"(step {1e3 * self.step_seconds / n:.2f} ms, in the worker "
                f"{1e3 * self.worker_seconds / n:.2f} ms)")


class Executor(ABC):
    """Runs the model for the engine (see the module docstring).

    `kv_cache_spec` and `num_params` describe one worker's shard (its KV heads); `model` and
    `kv_cache` are set only when they live in this process.
    """

    kv_cache_spec: KVCacheSpec
    num_params: int
    model: torch.nn.Module | None = None
    kv_cache: KVCache | None = None
    # speculative decoding with a draft model: its KV spec (each block holds its K/V too), and
    # the seconds rank 0 spent in it, summed over steps
    draft_kv_cache_spec: KVCacheSpec | None = None
    draft_seconds: float = 0.0

    def __init__(self) -> None:
        self._error: BaseException | None = None
        self._listeners: list[Callable[[BaseException], None]] = []
        self._fail_lock = threading.Lock()

    @abstractmethod
    def init_cache(self, cache: CacheConfig) -> None:
        """Allocate (or reallocate) every worker's KV cache; requests in flight are forgotten."""

    def profile_memory(self, prof: ProfileConfig) -> list[MemoryProfile]:
        """Free every worker's KV cache and profile the largest step on each (CUDA only); one
        profile per rank."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile GPU memory")

    @abstractmethod
    def execute(self, step: StepInput) -> list[SeqStepOutput]:
        """Run one step; one entry per row, in order. Raises
        `WorkerDiedError` (never hangs) once a worker is gone."""

    def free_cache(self) -> None:
        """Free every worker's KV cache (`init_cache` allocates it again); `LLM.sleep`."""
        raise NotImplementedError(f"{type(self).__name__} cannot free its workers' KV caches")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Call `method` on every worker, one result per rank: a `Worker` method's name, or a
        function called as `method(worker, *args, **kwargs)` (vLLM's `collective_rpc`)."""
        raise NotImplementedError(f"{type(self).__name__} does not run collective_rpc")

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a worker has died."""
        if self._error is not None:
            raise WorkerDiedError(str(self._error)) from self._error

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""

    def add_failure_listener(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` once, from any thread, as soon as a worker is found dead (also
        while the engine is idle; at once if it already is). A server uses it to fail fast."""
        with self._fail_lock:
            error = self._error
            if error is None:
                self._listeners.append(callback)
        if error is not None:
            _notify(callback, error)

    def _fail(self, error: BaseException) -> BaseException:
        """Record the first failure, stop every worker, tell the listeners; returns the error to
        raise (the first one)."""
        with self._fail_lock:
            if self._error is not None:
                return self._error
            self._error = error
        self._stop_workers()
        for callback in self._listeners:
            _notify(callback, error)
        return error

    def _stop_workers(self) -> None:
        """Stop every worker at once (after a failure)."""


def _notify(callback: Callable[[BaseException], None], error: BaseException) -> None:
    try:
        callback(error)
    except Exception:  # noqa: BLE001 - a listener's bug must not hide the worker's failure
        logger.exception("a worker-failure listener raised")
