"""Tensor-parallel workers as Ray actors, across the machines of a Ray cluster.

The driver connects to the cluster at `ray_address` (`ray.init(address=...)`; None joins a Ray
instance already running on this machine or starts a local one), reserves one bundle per rank in
a placement group (packed onto as few machines as possible), starts one actor per bundle and joins
them in a gloo / NCCL group rendezvousing at rank 0's node. Each step the pickled `StepMessage` is
put in Ray's object store once and every actor reads it; rank 0 returns the outputs. Ray reports
a dead actor as an error on its pending call, so a step never hangs on a lost worker.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from pagedserve.core.step_input import StepInput
from pagedserve.distributed.process_group import free_port
from pagedserve.worker.executor_base import CommStats, Executor, WorkerDiedError
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.platforms import platform_for
from pagedserve.worker.step_message import StepEncoder
from pagedserve.worker.worker import CacheConfig, ModelInfo, StepReply, Worker, WorkerConfig

# How long to wait for the cluster to find room for every worker.
PLACEMENT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 10.0


class WorkerActor:
    """One rank's `Worker` inside a Ray actor (wrapped with `ray.remote` when the executor starts,
    so that importing this module needs no Ray)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0 hosts the process group's store)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def start(self, config: WorkerConfig, rank: int, init_method: str) -> ModelInfo:
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here.
        self.worker = Worker(config, rank, init_method, device_index=0)
        return self.worker.info()

    def init_cache(self, cache: CacheConfig) -> None:
        self.worker.init_cache(cache)

    def profile_memory(self, prof):
        return self.worker.profile_memory(prof)

    def execute(self, payload: bytes) -> StepReply:
        return self.worker.execute(pickle.loads(payload))

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class RayExecutor(Executor):
    """`config.world_size` Ray actors, one per tensor-parallel rank; see the module docstring."""

    def __init__(self, config: WorkerConfig, address: str | None = None) -> None:
        super().__init__()
        try:
            import ray
        except ImportError as e:
            raise ValueError("distributed_executor_backend='ray' needs Ray: "
                             "pip install 'pagedserve[ray]'") from e
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        self.world_size = config.world_size
        self.encoder = StepEncoder()
        self.stats = CommStats()
        self._closed = False
        self._actors: list[Any] = []
        bundle = platform_for(config.device_type).worker_bundle()
        self._pg = placement_group([bundle] * config.world_size, strategy="PACK")
        try:
            try:
                ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(
                    f"the Ray cluster has no room for {config.world_size} workers of {bundle} "
                    f"(available: {ray.available_resources()})") from None
            actor_class = ray.remote(WorkerActor)
            for rank in range(config.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank)
                self._actors.append(actor_class.options(
                    num_cpus=1, num_gpus=bundle.get("GPU", 0), max_concurrency=2,
                    scheduling_strategy=strategy, name=None,
                ).remote())
            ip, port = ray.get(self._actors[0].rendezvous_address.remote())
            init_method = f"tcp://{ip}:{port}"
            info = self._get([actor.start.remote(config, rank, init_method)
                              for rank, actor in enumerate(self._actors)])[0]
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache_spec, self.num_params = info.kv_cache_spec, info.num_params
        self.draft_kv_cache_spec = info.draft_kv_cache_spec

    def init_cache(self, cache: CacheConfig) -> None:
        self.check_health()
        self._get([actor.init_cache.remote(cache) for actor in self._actors])

    def profile_memory(self, prof):
        self.check_health()
        return self._get([actor.profile_memory.remote(prof) for actor in self._actors])

    def execute(self, step: StepInput) -> list[SeqStepOutput]:
        super().check_health()
        start = time.perf_counter()
        payload = pickle.dumps(self.encoder.encode(step), protocol=pickle.HIGHEST_PROTOCOL)
        ref = self._ray.put(payload)
        replies = self._get([actor.execute.remote(ref) for actor in self._actors])
        self.stats.record(len(payload), 0, time.perf_counter() - start, replies[0].seconds)
        self.draft_seconds += replies[0].draft_seconds
        return replies[0].outputs

    def check_health(self) -> None:
        super().check_health()
        ray = self._ray
        refs = [actor.ping.remote() for actor in self._actors]
        try:
            ray.get(refs, timeout=HEALTH_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            raise self._fail(WorkerDiedError(f"a tensor-parallel Ray worker is gone: {e}")) from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if self._error is None and self._actors:
            try:
                ray.get([actor.close.remote() for actor in self._actors], timeout=HEALTH_TIMEOUT_S)
            except ray.exceptions.RayError:
                pass
        self._stop_workers()
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()

    def _get(self, refs: list) -> list[Any]:
        """The results of one call per rank, in rank order; `WorkerDiedError` at the first
        failure (the other ranks may be stuck in a collective: they are killed)."""
        ray = self._ray
        results: list[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise self._fail(WorkerDiedError(
                        f"tensor-parallel worker {rank} (Ray actor) failed: {e}")) from None
        return results

    def _stop_workers(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
