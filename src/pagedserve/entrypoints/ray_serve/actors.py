"""The Serve app's one `CacheIndex` as a named, detached Ray actor (`cache_index_actor`), created
by whichever side asks first (an ingress replica's request router or an engine replica) and
found by name by the others.

NOTE: detached, so that it outlives the replica that happened to create it (Serve scales
replicas down); it is registered with Serve's controller for removal at `serve.shutdown()`, as
Ray Serve LLM's prefix tree actor is (`serve.delete(app)` leaves it: `ray.kill` it, see
`existing_cache_index`, or reuse the app name, which clears nothing but the replicas' entries
as they leave).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

INDEX_NAMESPACE = "pagedserve"


def index_actor_name(app_name: str) -> str:
    return f"{app_name}-cache-index"


def cache_index_actor(app_name: str, policy: str = "prefix", block_size: int = 16,
                      threshold: int | None = None):
    """The handle of `app_name`'s cache index actor (created with these settings when it does
    not exist yet)."""
    import ray

    from pagedserve.entrypoints.ray_serve.cache_index import CacheIndex

    kwargs = {"policy": policy, "block_size": block_size}
    if threshold is not None:
        kwargs["threshold"] = threshold
    # NOTE: one call at a time (max_concurrency 1): reports and choices apply in order.
    actor = ray.remote(CacheIndex).options(
        name=index_actor_name(app_name), namespace=INDEX_NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=1).remote(**kwargs)
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(actor)
    except Exception as e:  # outside Serve (a unit test), or Serve's private API moved
        logger.debug("cache index actor not registered for cleanup: %s", e)
    return actor


def existing_cache_index(app_name: str):
    """The handle of `app_name`'s running cache index actor (ValueError when there is none)."""
    import ray

    return ray.get_actor(index_actor_name(app_name), namespace=INDEX_NAMESPACE)
