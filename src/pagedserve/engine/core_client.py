"""The front end's link to its engine cores: starting them, the sockets, watching them die.

`CoreClient` starts `data_parallel_size` engine cores (`engine/core_proc.py`), on this machine
as spawned processes (`--data-parallel-backend mp`: the CPUs split between them, each core's
compute threads bound to its share) or as Ray actors, one placement group each
(`--data-parallel-backend ray`, as the tensor-parallel Ray executor places its workers). The
front end binds one zmq PULL socket for every core's outputs and one PUSH socket per core for
its inputs (ipc paths locally, tcp on the driver's address with Ray); the cores connect.

A receive thread decodes every frame (typed msgspec decoding only) into `messages`, a queue the
front end's engine reads, and settles utility calls. A monitor thread watches the cores (their
processes' sentinels, or their actors' `run` calls): a core that ends without being asked puts a
`CoreDied` message (naming the engine, its pid and exit code) in the same queue, so the front
end learns of a death in order with the outputs, never by waiting on a socket that will stay
silent.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineArgs, parse_cpu_list
from pagedserve.engine.core_messages import (
    CoreReady,
    CoreShutdown,
    CoreUtility,
    decode_output,
    encode,
)
from pagedserve.engine.core_proc import CoreActor, CoreConfig, run_core_process
from pagedserve.engine.kv_events import KVEventsConfig
from pagedserve.engine.request_stream import EngineDeadError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class CoreDied:
    """An engine core ended without being asked to."""

    engine_index: int
    reason: str


class EngineCoreDiedError(EngineDeadError):
    """A request was lost with the engine core running it (the server's 503 naming the
    engine)."""


def core_thread_plan(args: EngineArgs, n: int) -> list[tuple[int | None, str | None]]:
    """(cpu_threads, cpu_threads_bind) for each of `n` local cores: the CPUs this process may
    use (or `cpu_threads_bind`'s list) split into `n` contiguous shares, each core's threads
    bound to its share; unbound even shares of `cpu_threads` when there are fewer CPUs than
    cores. One core keeps the options as given."""
    if n == 1:
        return [(args.cpu_threads, args.cpu_threads_bind)]
    cpus = parse_cpu_list(args.cpu_threads_bind or "auto", limit=args.cpu_threads)
    share = len(cpus) // n
    if share >= 1:
        return [(share, ",".join(str(c) for c in cpus[i * share:(i + 1) * share]))
                for i in range(n)]
    total = args.cpu_threads or os.cpu_count() or 1
    return [(max(1, total // n), None)] * n


class CoreClient:
    """Starts the cores and talks to them (see the module docstring)."""

    def __init__(self, args: EngineArgs, kv_events: KVEventsConfig | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        import zmq

        self.args = args
        self.num_engines = args.data_parallel_size
        self.backend = args.data_parallel_backend
        self.kv_events = kv_events
        self.messages: queue.Queue = queue.Queue()
        self.ready: list[CoreReady | None] = [None] * self.num_engines
        self.alive = [False] * self.num_engines
        self.death_reasons: dict[int, str] = {}
        self._ctx = zmq.Context()
        self._closing = False
        self._procs: list[Any] = [None] * self.num_engines
        self._actors: list[Any] = [None] * self.num_engines
        self._run_refs: list[Any] = [None] * self.num_engines
        self._pgs: list[Any] = []
        self._tmp = tempfile.mkdtemp(prefix="pagedserve-dp-")
        self._send_locks = [threading.Lock() for _ in range(self.num_engines)]
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        host = "127.0.0.1"
        if self.backend == "ray":
            host = self._start_ray()
        self._output = self._ctx.socket(zmq.PULL)
        self._inputs = [self._ctx.socket(zmq.PUSH) for _ in range(self.num_engines)]
        if self.backend == "ray":
            port = self._output.bind_to_random_port("tcp://*")
            self.output_address = f"tcp://{host}:{port}"
            self.input_addresses = [f"tcp://{host}:{s.bind_to_random_port('tcp://*')}"
                                    for s in self._inputs]
        else:
            self.output_address = f"ipc://{self._tmp}/out"
            self._output.bind(self.output_address)
            self.input_addresses = []
            for i, s in enumerate(self._inputs):
                address = f"ipc://{self._tmp}/in{i}"
                s.bind(address)
                self.input_addresses.append(address)
        for s in self._inputs:
            s.setsockopt(zmq.LINGER, 0)
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._tmp)
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            self._start_cores()
            self._await_ready(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._receiver = threading.Thread(target=self._receive, name="pagedserve-core-recv",
                                          daemon=True)
        self._receiver.start()
        self._monitor = threading.Thread(target=self._watch, name="pagedserve-core-monitor",
                                         daemon=True)
        self._monitor.start()

    # --- starting ----------------------------------------------------------------------------

    def _core_config(self, index: int, threads: int | None, bind: str | None) -> CoreConfig:
        args = dataclasses.replace(self.args, data_parallel_size=1, cpu_threads=threads,
                                   cpu_threads_bind=bind)
        affinity = tuple(parse_cpu_list(bind)) if bind else ()
        return CoreConfig(args, index, self.input_addresses[index], self.output_address,
                          self.kv_events, affinity)

    def _start_cores(self) -> None:
        if self.backend == "ray":
            return self._start_actors()
        ctx = mp.get_context("spawn")
        plan = core_thread_plan(self.args, self.num_engines)
        for i, (threads, bind) in enumerate(plan):
            self._start_process(ctx, i, threads, bind)
        self._plan = plan

    def _start_process(self, ctx, index: int, threads, bind) -> None:
        # NOTE: not a daemon: a core with tensor-parallel workers starts processes of its own.
        # It exits with this process (core_proc.run_core_process watches its parent).
        proc = ctx.Process(target=run_core_process, args=(self._core_config(index, threads, bind),),
                           name=f"pagedserve-core{index}", daemon=False)
        proc.start()
        self._procs[index] = proc

    def _start_ray(self) -> str:
        try:
            import ray
        except ImportError as e:
            raise ValueError("data_parallel_backend='ray' needs Ray: pip install "
                             "'pagedserve[ray]'") from e
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=self.args.ray_address, include_dashboard=False, log_to_driver=True)
        return ray.util.get_node_ip_address()

    def _start_actors(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        threads = self.args.cpu_threads or 1
        gpu = self.args.device.startswith("cuda")
        bundle = {"CPU": float(threads)} | ({"GPU": 1.0} if gpu else {})
        actor_class = ray.remote(CoreActor)
        for i in range(self.num_engines):
            pg = placement_group([bundle], strategy="PACK")
            self._pgs.append(pg)
            try:
                ray.get(pg.ready(), timeout=120.0)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(f"the Ray cluster has no room for engine core {i} ({bundle}; "
                                 f"available: {ray.available_resources()})") from None
            actor = actor_class.options(
                num_cpus=threads, num_gpus=1 if gpu else 0, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0)).remote()
            self._actors[i] = actor
            self._run_refs[i] = actor.run.remote(self._core_config(i, threads, None))

    def _await_ready(self, timeout: float) -> None:
        import zmq

        deadline = time.monotonic() + timeout
        while not all(self.ready):
            dead = self._find_dead()
            if dead is not None:
                raise RuntimeError(f"engine core {dead.engine_index} failed to start: "
                                   f"{dead.reason} (its log is above; a script that creates "
                                   "the engine must do so under `if __name__ == '__main__':`)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine cores did not start within {timeout:.0f} s")
            if self._output.poll(200, zmq.POLLIN):
                msg = decode_output(self._output.recv())
                if isinstance(msg, CoreReady):
                    self.ready[msg.engine_index] = msg
                    self.alive[msg.engine_index] = True
                    logger.info("engine core %d ready (pid %d on %s): %d KV blocks",
                                msg.engine_index, msg.pid, msg.node, msg.num_kv_blocks)

    # --- talking -------------------------------------------------------------------------------

    def send(self, engine: int, msg) -> None:
        """Send one message to core `engine` (thread-safe; dropped for a dead core)."""
        if not self.alive[engine]:
            return
        frame = encode(msg)
        with self._send_locks[engine]:
            self._inputs[engine].send(frame, copy=False)

    def call(self, engine: int, method: str, *args, timeout: float = 60.0) -> Any:
        """A utility call on one core (`core_proc.UTILITY_METHODS`), waited for; its error as
        RuntimeError (ValueError when the core raised one)."""
        if not self.alive[engine]:
            raise RuntimeError(f"engine core {engine} is not alive")
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        self.send(engine, CoreUtility(call_id, method, list(args)))
        try:
            return future.result(timeout)
        finally:
            self._calls.pop(call_id, None)

    def call_all(self, method: str, *args, timeout: float = 60.0) -> list[Any]:
        return [self.call(i, method, *args, timeout=timeout)
                for i in range(self.num_engines) if self.alive[i]]

    def _receive(self) -> None:
        import zmq

        while not self._closing:
            try:
                if not self._output.poll(500, zmq.POLLIN):
                    continue
                frame = self._output.recv()
            except zmq.ZMQError:
                return
            msg = decode_output(frame)
            if isinstance(msg, CoreReady):  # a restarted core
                self.ready[msg.engine_index] = msg
                self.alive[msg.engine_index] = True
                self.messages.put(msg)
                continue
            for call_id, ok, result in msg.utility:
                future = self._calls.get(call_id)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(result)
                    else:
                        error = ValueError if result.startswith("ValueError") else RuntimeError
                        future.set_exception(error(result))
            self.messages.put(msg)

    # --- deaths ------------------------------------------------------------------------------

    def _find_dead(self) -> CoreDied | None:
        """A core that ended (None when all run)."""
        for i in range(self.num_engines):
            reason = self._death(i)
            if reason is not None and i not in self.death_reasons:
                return CoreDied(i, reason)
        return None

    def _death(self, i: int) -> str | None:
        proc = self._procs[i]
        if proc is not None:
            if proc.exitcode is None:
                return None
            return f"its process (pid {proc.pid}) exited with code {proc.exitcode}"
        ref = self._run_refs[i]
        if ref is None:
            return None
        ready, _ = self._ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            self._ray.get(ref)
            return "its Ray actor returned"
        except Exception as e:  # noqa: BLE001 - the actor's end, reported
            return f"its Ray actor failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        while not self._closing:
            sentinels = [p.sentinel for i, p in enumerate(self._procs)
                         if p is not None and self.alive[i]]
            if sentinels:
                wait(sentinels, timeout=0.5)
            else:
                time.sleep(0.5)
            if self._closing:
                return
            for i in range(self.num_engines):
                if not self.alive[i]:
                    continue
                reason = self._death(i)
                if reason is not None:
                    self.alive[i] = False
                    self.death_reasons[i] = reason
                    logger.error("engine core %d died: %s", i, reason)
                    for call_id, future in list(self._calls.items()):
                        if not future.done():
                            future.set_exception(RuntimeError(f"engine core {i} died: {reason}"))
                    self.messages.put(CoreDied(i, reason))

    def pid(self, engine: int) -> int | None:
        ready = self.ready[engine]
        return ready.pid if ready is not None else None

    def kill(self, engine: int) -> None:
        """Kill core `engine` at once (tests and fault drills: SIGKILL its process / actor)."""
        proc = self._procs[engine]
        if proc is not None:
            proc.kill()
        elif self._actors[engine] is not None:
            self._ray.kill(self._actors[engine], no_restart=True)

    def restart(self, engine: int) -> None:
        """Start a fresh core in a dead one's place (mp backend): its `CoreReady` arrives in
        `messages` when it has loaded the model."""
        if self.alive[engine]:
            raise RuntimeError(f"engine core {engine} is alive")
        if self.backend != "mp":
            raise RuntimeError("restarting engine cores needs data_parallel_backend='mp'")
        threads, bind = self._plan[engine]
        self.death_reasons.pop(engine, None)
        self._start_process(mp.get_context("spawn"), engine, threads, bind)

    # --- stopping ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for i in range(self.num_engines):
            if self.alive[i]:
                try:
                    with self._send_locks[i]:
                        self._inputs[i].send(encode(CoreShutdown()))
                except Exception:  # noqa: BLE001 - the socket may be gone
                    pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for thread in (getattr(self, "_receiver", None), getattr(self, "_monitor", None)):
            if thread is not None and thread is not threading.current_thread():
                thread.join(2.0)
        for proc in self._procs:
            if proc is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(2.0)
        if self._actors and any(a is not None for a in self._actors):
            ray = self._ray
            refs = [r for r in self._run_refs if r is not None]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001
                pass
            for actor in self._actors:
                if actor is not None:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
            from ray.util.placement_group import remove_placement_group

            for pg in self._pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
            if self._owns_ray:
                ray.shutdown()
        for s in [*getattr(self, "_inputs", []), getattr(self, "_output", None)]:
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _cleanup(procs, tmp) -> None:
    for proc in procs:
        if proc is not None and proc.exitcode is None:
            proc.kill()
    shutil.rmtree(tmp, ignore_errors=True)


def _shutdown_at_exit(ref) -> None:
    client = ref()
    if client is not None:
        client.shutdown()
