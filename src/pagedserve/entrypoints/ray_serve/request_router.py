"""`CacheAffinityRouter`: Ray Serve's request router for the engine replicas (Serve calls it in
each process holding a handle to them: the ingress replicas).

Each request's routing needs (`route_of`: its prompt token ids, adapter and cache salt, the
first argument of `EngineReplica.generate`) go to the app's `CacheIndex` actor, which answers
with the replica by `--data-parallel-routing`'s rules (the longest cached prefix unless too
loaded, least load, round robin). The chosen replica is Serve's first rank, the others its
fallback (Serve moves on when the chosen one is at `max_ongoing_requests`). Serve's replica set
updates and deaths are passed on to the index, so replicas that left drop out of it.
"""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.entrypoints.ray_serve.actors import cache_index_actor

logger = logging.getLogger(__name__)


def route_of(pending_request: PendingRequest | None) -> dict | None:
    """The routing fields of a request to `EngineReplica.generate` (None for other calls)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    if isinstance(first, dict) and "prompt_token_ids" in first:
        return first
    return None


class CacheAffinityRouter(RequestRouter):
    """Routes by the app's cache index (see the module docstring). `request_router_kwargs`:
    app_name, policy, block_size, threshold."""

    def initialize_state(self, app_name: str = "pagedserve", policy: str = "prefix",
                         block_size: int = 16, threshold: int | None = None, **_) -> None:
        self._index = cache_index_actor(app_name, policy, block_size, threshold)
        if threshold is not None:  # a redeploy may change them: the actor outlives it
            self._index.configure.remote(policy, block_size, threshold)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        route = route_of(pending_request)
        if route is None or not candidate_replicas:  # info() and other calls: any replica
            return [candidate_replicas]
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        try:
            chosen = await self._index.choose.remote(
                route["prompt_token_ids"], route.get("lora_id"), route.get("cache_salt"),
                list(by_id))
        except Exception as e:  # never strand a request on the index: any replica serves it
            logger.warning("cache index unavailable (%s): routing to any replica", e)
            return [candidate_replicas]
        first = by_id.get(chosen)
        if first is None:
            return [candidate_replicas]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if getattr(self, "_index", None) is not None:
            self._index.sync_replicas.remote([r.replica_id.to_full_id_str() for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if getattr(self, "_index", None) is not None:
            self._index.remove_replica.remote(replica_id.to_full_id_str())
