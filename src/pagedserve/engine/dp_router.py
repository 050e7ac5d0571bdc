"""Which engine core takes a request (`--data-parallel-routing`).

- `prefix` (default): the core holding the longest cached prefix of the request's prompt, read
  from an exact index of what every core's prefix cache holds (`PrefixIndex`, fed the KV events
  each core reports every step), unless that core is overloaded: its load exceeds the least
  loaded core's, plus the history that core lacks (which it would compute again), by more than
  `threshold` tokens and by more than half (`LOAD_RATIO`); then the least loaded. Without a hit anywhere: the least loaded core,
  preferring, for a request with a LoRA adapter, the cores that served that adapter recently (it
  is loaded there).
- `least-load`: the least loaded core (ties: the one that took the fewest requests).
- `round-robin`: the next live core in turn.

A core's load is its queued plus running tokens: the context (prompt + output so far) of every
request the front end has in flight on it, kept current by the front end as requests are routed,
advance and end (`add_load`), so routing between two steps already sees the requests routed
a moment ago. Lost cores (`mark_dead`) are never chosen.

Pure Python (no torch), so that the Ray Serve request router reuses it
(`entrypoints/ray_serve/cache_index.py`: replicas come and go there, `add_engine`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

ROUTING_POLICIES = ("prefix", "least-load", "round-robin")
DEFAULT_LOAD_THRESHOLD = 2048  # tokens
# a prefix core is overloaded only past both the threshold and this ratio (SGLang's router's
# balance_rel_threshold): with long histories a fixed number of tokens is one conversation
LOAD_RATIO = 1.5


class PrefixIndex:
    """Who holds which full block, from the cores' KV events (vLLM's BlockStored /
    BlockRemoved / AllBlocksCleared).

    A block is keyed by its own chain: key = hash((parent key, its tokens)), the chain's root
    derived from the adapter id and the cache salt, so the same prefix on two cores has the same
    key whatever each core's own hash values (they differ between processes). The index maps
    each core's published hash to its key (to read removals and parents) and each key to the
    cores holding it.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: dict[int, dict[int, int]] = {}  # core -> published hash -> key
        self._holders: dict[int, set[int]] = {}  # key -> cores

    @staticmethod
    def root(lora_id: int | None, salt: str | None) -> int:
        return hash(("prefix-root", lora_id, salt))

    def apply(self, core: int, batch) -> None:
        """Apply one core's event batch (a `kv_events.KVEventBatch`)."""
        keys = self._keys.setdefault(core, {})
        bs = self.block_size
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                salt = None
                if event.extra_keys and event.extra_keys[0]:
                    salt = event.extra_keys[0][0]
                parent = (self.root(event.lora_id, salt) if event.parent_block_hash is None
                          else keys.get(event.parent_block_hash))
                if parent is None:  # its parent was never seen (events lost): skip the chain
                    continue
                tokens = event.token_ids
                for i, h in enumerate(event.block_hashes):
                    key = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
                    keys[h] = key
                    self._holders.setdefault(key, set()).add(core)
                    parent = key
            elif kind == "BlockRemoved":
                for h in event.block_hashes:
                    key = keys.pop(h, None)
                    if key is not None:
                        self._drop(key, core)
            elif kind == "AllBlocksCleared":
                self.clear(core)

    def _drop(self, key: int, core: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(core)
            if not holders:
                del self._holders[key]

    def clear(self, core: int) -> None:
        """Forget everything `core` held (its cache was reset, or it died)."""
        for key in self._keys.pop(core, {}).values():
            self._drop(key, core)

    def match(self, token_ids: list[int], lora_id: int | None = None,
              salt: str | None = None) -> dict[int, int]:
        """Per core, how many leading full blocks of `token_ids` it holds (cores with none are
        left out)."""
        bs = self.block_size
        parent = self.root(lora_id, salt)
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        # NOTE: as the cores' own match, the last token is never counted (it is computed).
        for i in range((len(token_ids) - 1) // bs):
            key = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            holders = self._holders.get(key)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for core in alive:
                matched[core] = i + 1
            parent = key
        return matched

    def num_blocks(self, core: int) -> int:
        return len(self._keys.get(core, ()))


class Router:
    """Chooses a core per request (see the module docstring)."""

    def __init__(self, num_engines: int, policy: str = "prefix", block_size: int = 16,
                 threshold: int = DEFAULT_LOAD_THRESHOLD, loras_per_engine: int = 1) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing must be one of {ROUTING_POLICIES}, "
                             f"got {policy!r}")
        self.num_engines = num_engines
        self.policy = policy
        self.threshold = threshold
        self.index = PrefixIndex(block_size)
        self.load = [0] * num_engines
        self.alive = [True] * num_engines
        self._rr = itertools.cycle(range(num_engines))
        self._loras: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]
        self._loras_per_engine = max(1, loras_per_engine)
        self.routed = [0] * num_engines
        self.prefix_routed = 0  # requests sent to the core holding their longest prefix
        self.overloaded = 0  # requests whose prefix core was too loaded (sent elsewhere)

    def live(self) -> list[int]:
        return [i for i in range(self.num_engines) if self.alive[i]]

    def choose(self, token_ids: list[int], lora_id: int | None = None,
               salt: str | None = None, exclude: set[int] | frozenset = frozenset()) -> int:
        """The core for a request (ValueError-free: RuntimeError when no core is alive)."""
        live = [i for i in self.live() if i not in exclude]
        if not live:
            raise RuntimeError("no engine core is alive")
        if self.policy == "round-robin":
            for _ in range(self.num_engines):
                i = next(self._rr)
                if i in live:
                    return self._chosen(i, lora_id)
        # NOTE: ties (an idle pool) go to the core that took the fewest requests, so new
        # conversations spread over the cores even one at a time
        least = min(live, key=lambda i: (self.load[i], self.routed[i], i))
        if self.policy == "least-load":
            return self._chosen(least, lora_id)
        matched = self.index.match(token_ids, lora_id, salt)
        matched = {i: n for i, n in matched.items() if i in live}
        if matched:
            best = max(matched, key=lambda i: (matched[i], -self.load[i], -i))
            # NOTE: the prompt's tokens that a core lacks join its load there: elsewhere the
            # whole history is computed again, which is the load the prefix core is spared
            spared = (matched[best] - matched.get(least, 0)) * self.index.block_size
            other = self.load[least] + spared
            if (self.load[best] - other <= self.threshold
                    or self.load[best] <= LOAD_RATIO * other):
                self.prefix_routed += 1
                return self._chosen(best, lora_id)
            self.overloaded += 1
            return self._chosen(least, lora_id)
        if lora_id is not None:
            having = [i for i in live if lora_id in self._loras[i]]
            if having:
                best = min(having, key=lambda i: (self.load[i], self.routed[i], i))
                if self.load[best] - self.load[least] <= self.threshold:
                    return self._chosen(best, lora_id)
        return self._chosen(least, lora_id)

    def _chosen(self, core: int, lora_id: int | None) -> int:
        self.routed[core] += 1
        if lora_id is not None:
            loras = self._loras[core]
            loras[lora_id] = None
            loras.move_to_end(lora_id)
            while len(loras) > self._loras_per_engine:
                loras.popitem(last=False)
        return core

    def add_load(self, core: int, tokens: int) -> None:
        self.load[core] += tokens

    def apply_events(self, core: int, batch) -> None:
        self.index.apply(core, batch)

    def mark_dead(self, core: int) -> None:
        self.alive[core] = False
        self.index.clear(core)
        self.load[core] = 0
        self._loras[core].clear()

    def mark_alive(self, core: int) -> None:
        self.alive[core] = True

    def add_engine(self) -> int:
        """A new core (a Ray Serve replica that started): its index. NOTE: indices are never
        reused; a core that left is `mark_dead` for good."""
        self.num_engines += 1
        self.load.append(0)
        self.alive.append(True)
        self.routed.append(0)
        self._loras.append(OrderedDict())
        self._rr = itertools.cycle(range(self.num_engines))
        return self.num_engines - 1

    def set_load(self, core: int, tokens: int) -> None:
        """A core's own count of its queued plus running tokens (replaces the front end's)."""
        self.load[core] = tokens
