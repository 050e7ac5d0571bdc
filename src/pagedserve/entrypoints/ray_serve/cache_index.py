"""`CacheIndex`: the data-parallel `Router` (engine/dp_router.py) over a changing set of Ray
Serve engine replicas, keyed by their replica ids.

Replicas report each step's KV cache events (vLLM's msgpack `KVEventBatch`, the bytes
`kv_events.encode_batch` writes), their queued plus running tokens and their cumulative
prefix-cache counters (`report`); Serve's request router asks which replica takes a request
(`choose`, among the replicas Serve offers) and tells the index which replicas exist
(`sync_replicas`, `remove_replica`). A replica that left is `mark_dead` in the router: its blocks
leave the index and it is never chosen again, even when a late report of it arrives.

Pure Python (no ray, no torch): `ray_serve.actors` runs one as a named Ray actor shared by every
ingress replica's router and every engine replica.
"""

from __future__ import annotations

from pagedserve.engine.dp_router import DEFAULT_LOAD_THRESHOLD, Router
from pagedserve.engine.kv_events import decode_batch


class CacheIndex:
    """Routing state shared by the Serve app: which replica holds which prefix, and how loaded
    each is. `policy` and `threshold` as `--data-parallel-routing` and
    `--data-parallel-load-threshold`."""

    def __init__(self, policy: str = "prefix", block_size: int = 16,
                 threshold: int = DEFAULT_LOAD_THRESHOLD) -> None:
        self.router = Router(0, policy, block_size, threshold)
        self._slot: dict[str, int] = {}  # replica id -> the router's core index
        self._gone: set[str] = set()  # replicas that left (their late reports are ignored)
        self._counters: dict[str, tuple[int, int]] = {}  # replica id -> (hits, queries)

    def configure(self, policy: str, block_size: int, threshold: int) -> None:
        """The routing settings of a (re)deployed app; the actor outlives a redeploy under the
        same name. A new block size forgets the index (the replicas' blocks differ)."""
        from pagedserve.engine.dp_router import ROUTING_POLICIES, PrefixIndex

        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.router.policy = policy
        self.router.threshold = threshold
        if block_size != self.router.index.block_size:
            self.router.index = PrefixIndex(block_size)

    # --- the replica set -----------------------------------------------------------------------

    def _core(self, replica_id: str) -> int | None:
        """The router's index of a replica (a new one is added); None when it left."""
        if replica_id in self._gone:
            return None
        core = self._slot.get(replica_id)
        if core is None:
            core = self._slot[replica_id] = self.router.add_engine()
        return core

    def sync_replicas(self, replica_ids: list[str]) -> None:
        """The replicas Serve runs now: new ones join, missing ones leave."""
        current = set(replica_ids)
        for replica_id in replica_ids:
            self._core(replica_id)
        for replica_id in [r for r in self._slot if r not in current]:
            self.remove_replica(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """A replica stopped (scaled down or died): its blocks leave the index."""
        core = self._slot.pop(replica_id, None)
        self._gone.add(replica_id)
        self._counters.pop(replica_id, None)
        if core is not None:
            self.router.mark_dead(core)

    def replicas(self) -> list[str]:
        return list(self._slot)

    # --- reports and routing -------------------------------------------------------------------

    def report(self, replica_id: str, events: bytes | None, load: int,
               prefix_hits: int = 0, prefix_queries: int = 0) -> None:
        """One replica's news: its step's KV events (msgpack; None: none), its load now, and its
        cumulative prefix-cache hit and query counts (tokens)."""
        core = self._core(replica_id)
        if core is None:
            return
        if events is not None:
            self.router.apply_events(core, decode_batch(events))
        self.router.set_load(core, max(0, int(load)))
        self._counters[replica_id] = (prefix_hits, prefix_queries)

    def choose(self, token_ids: list[int], lora_id: int | None = None, salt: str | None = None,
               candidates: list[str] | None = None) -> str:
        """The replica for a request, among `candidates` (None: any). Its load grows by the
        prompt at once (the replica's next report replaces it), so a burst routed between two
        reports spreads by the threshold rule too. RuntimeError when no candidate is known."""
        allowed = None
        if candidates is not None:
            allowed = {c for c in (self._core(r) for r in candidates) if c is not None}
        exclude = frozenset() if allowed is None else frozenset(
            i for i in range(self.router.num_engines) if i not in allowed)
        core = self.router.choose(list(token_ids), lora_id, salt, exclude)
        self.router.add_load(core, len(token_ids))
        return next(r for r, c in self._slot.items() if c == core)

    def stats(self) -> dict:
        """Per replica: requests routed, load (tokens), blocks indexed, prefix-cache hits and
        queries (tokens, as the replica reported them); and the router's prefix_routed /
        overloaded counts."""
        r = self.router
        per = {}
        for replica_id, core in self._slot.items():
            hits, queries = self._counters.get(replica_id, (0, 0))
            per[replica_id] = {"routed": r.routed[core], "load": r.load[core],
                               "blocks": r.index.num_blocks(core), "prefix_hits": hits,
                               "prefix_queries": queries}
        return {"replicas": per, "prefix_routed": r.prefix_routed, "overloaded": r.overloaded,
                "policy": r.policy}
