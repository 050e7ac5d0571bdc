"""Tensor-parallel workers as processes on this machine (multiprocessing with "spawn").

The driver (the engine's process) holds no model. Each step it pickles the `StepMessage` once and
writes it to every worker's pipe; every rank runs its shard (the ranks meet in their all-reduces)
and answers, rank 0 with the sampled outputs. The driver waits on the pipes and on the processes
themselves, so a worker that dies ends the wait at once (`WorkerDiedError`) instead of hanging;
a monitor thread also notices a death while the engine is idle.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedserve.core.step_input import StepInput
from pagedserve.distributed.process_group import free_port
from pagedserve.worker.executor_base import CommStats, Executor, WorkerDiedError
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.worker.step_message import StepEncoder
from pagedserve.worker.worker import CacheConfig, Worker, WorkerConfig

logger = logging.getLogger(__name__)

_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --- the worker process ----------------------------------------------------------------------


def run_worker_process(config: WorkerConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Entry point of a worker process: build rank `rank`'s `Worker`, answer its model info, then
    serve the driver's calls ("init_cache", "execute", "free_cache", "rpc", ...) until "shutdown"
    or until the driver goes.

    NOTE: SIGINT is ignored: Ctrl-C reaches the whole process group, and the driver stops the
    workers itself (a worker interrupted inside an all-reduce would leave its peers waiting).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        worker = Worker(config, rank, init_method, device_index=rank)
        calls = {"init_cache": worker.init_cache, "execute": worker.execute,
                 "profile_memory": worker.profile_memory,
                 "free_cache": lambda _: worker.free_cache(),
                 "rpc": lambda call: worker.rpc(*call)}
        _answer(conn, "ok", worker.info())
        while True:
            method, arg = pickle.loads(conn.recv_bytes())
            if method == "shutdown":
                break
            _answer(conn, "ok", calls[method](arg))
    except EOFError:  # the driver is gone
        os._exit(1)
    except BaseException:  # noqa: BLE001 - reported to the driver, which stops every rank
        try:
            _answer(conn, "error", f"rank {rank}:\n{traceback.format_exc()}")
        finally:
            os._exit(1)
    worker.close()
    conn.close()


def _answer(conn: Connection, status: str, value: Any) -> None:
    conn.send_bytes(pickle.dumps((status, value), protocol=_PROTOCOL))


def _exit_with_parent() -> None:
    """Exit when the driver process dies, even while stuck in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


# --- the driver side -------------------------------------------------------------------------


class MultiprocExecutor(Executor):
    """`config.world_size` spawned worker processes, one per tensor-parallel rank, joined by a gloo
    (CPU) or NCCL (CUDA, rank r on GPU r) process group on 127.0.0.1. See the module docstring."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__()
        ctx = mp.get_context("spawn")
        self.world_size = config.world_size
        self.encoder = StepEncoder()
        self.stats = CommStats()
        self._closed = False
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(config.world_size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=run_worker_process, args=(config, rank, init_method, theirs),
                               name=f"pagedserve-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        # NOTE: the finalizer, the exit hook and the monitor thread hold no reference to `self`:
        # an executor dropped without `shutdown()` still stops its processes when collected, and
        # at interpreter exit it shuts down before multiprocessing terminates its children.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self._procs), list(self._conns))
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            info = self._collect()[0]
        except WorkerDiedError as e:
            self.shutdown()
            raise WorkerDiedError(
                f"the tensor-parallel workers failed to start: {e} (they are spawned processes: "
                "a script that creates the engine must do so under `if __name__ == '__main__':`)"
            ) from None
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache_spec, self.num_params = info.kv_cache_spec, info.num_params
        self.draft_kv_cache_spec = info.draft_kv_cache_spec
        self._stop_reader, self._stop_signal = ctx.Pipe(duplex=False)
        self._monitor = threading.Thread(
            target=_monitor, args=(weakref.ref(self), list(self._procs), self._stop_reader),
            name="pagedserve-worker-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, in rank order."""
        return [proc.pid for proc in self._procs]

    # --- calls ---------------------------------------------------------------------------

    def init_cache(self, cache: CacheConfig) -> None:
        self._call("init_cache", cache)

    def profile_memory(self, prof):
        return self._call("profile_memory", prof)

    def free_cache(self) -> None:
        self._call("free_cache", None)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        # NOTE: `method` crosses a pipe: a name, or a function importable by the workers.
        return self._call("rpc", (method, args, kwargs or {}))

    def execute(self, step: StepInput) -> list[SeqStepOutput]:
        self.check_health()
        start = time.perf_counter()
        payload = pickle.dumps(("execute", self.encoder.encode(step)), protocol=_PROTOCOL)
        self._send(payload)
        received = [0]
        replies = self._collect(received)
        self.stats.record(len(payload), received[0], time.perf_counter() - start, replies[0].seconds)
        self.draft_seconds += replies[0].draft_seconds
        return replies[0].outputs

    def check_health(self) -> None:
        super().check_health()
        if self._closed:
            raise WorkerDiedError("the tensor-parallel workers have been shut down")
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise self._fail(self._death(rank))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_monitor"):
            self._stop_signal.send_bytes(b"")
            self._monitor.join(timeout=5)
            self._stop_signal.close()
            self._stop_reader.close()
        if self._error is None:
            try:
                self._send(pickle.dumps(("shutdown", None), protocol=_PROTOCOL))
                for proc in self._procs:
                    proc.join(timeout=5)
            except WorkerDiedError:
                pass
        self._finalizer()

    # --- plumbing ------------------------------------------------------------------------

    def _call(self, method: str, arg: Any) -> list[Any]:
        self.check_health()
        self._send(pickle.dumps((method, arg), protocol=_PROTOCOL))
        return self._collect()

    def _send(self, payload: bytes) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                raise self._fail(self._death(rank)) from None

    def _collect(self, received: list[int] | None = None) -> list[Any]:
        """Every rank's answer to the call just sent, in rank order. Raises `WorkerDiedError` as
        soon as a worker reports an error or its process ends."""
        results: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            ready = wait([*pending, *sentinels])
            for obj in ready:
                rank = pending.pop(obj, None)
                if rank is None:
                    continue
                try:
                    data = obj.recv_bytes()
                except (EOFError, OSError):
                    raise self._fail(self._death(rank)) from None
                status, value = pickle.loads(data)
                if status == "error":
                    raise self._fail(WorkerDiedError(f"tensor-parallel worker {value}"))
                if received is not None:
                    received[0] += len(data)
                results[rank] = value
            for obj in ready:
                if obj in sentinels:
                    raise self._fail(self._death(sentinels[obj]))
        return results

    def _death(self, rank: int) -> WorkerDiedError:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return WorkerDiedError(
            f"tensor-parallel worker {rank} (pid {proc.pid}) died with exit code {proc.exitcode}; "
            "the engine cannot continue")

    def _stop_workers(self) -> None:
        _stop_processes(self._procs, [])


def _shutdown_at_exit(executor_ref: weakref.ref) -> None:
    executor = executor_ref()
    if executor is not None:
        executor.shutdown()


def _monitor(executor_ref: weakref.ref, procs: list, stop: Connection) -> None:
    """Wait for a worker process to end (or for `stop`); a death fails the executor at once."""
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    ready = wait([*sentinels, stop])
    if stop in ready:
        return
    executor = executor_ref()
    if executor is not None and not executor._closed:
        error = executor._fail(executor._death(sentinels[ready[0]]))
        logger.error("%s", error)


def _stop_processes(procs: list, conns: list[Connection]) -> None:
    """Terminate the processes still running (then kill any that linger); close the pipes."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)
    for conn in conns:
        conn.close()
