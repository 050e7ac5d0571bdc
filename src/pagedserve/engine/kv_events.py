"""KV cache events: what each engine core's prefix cache stored and dropped, in vLLM's schema.

An engine core's `KVCacheManager` calls a `KVEventSink` (its `events` seam) when a full block
enters the prefix cache (`stored`), when a cached block is handed out again and forgotten
(`removed`), and when the whole cache is reset (`cleared`). `KVEventCollector` gathers them into
vLLM's events, one batch per engine step:

- `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name)`: consecutive blocks of one chain, `parent_block_hash` the block before the first
  (None: the chain's first block), `token_ids` their tokens, concatenated;
- `BlockRemoved(block_hashes, medium)`;
- `AllBlocksCleared()`.

A batch is `KVEventBatch(ts, events, data_parallel_rank)`, msgpack-encoded with msgspec exactly
as vLLM's (`vllm/distributed/kv_events.py`: the batch an array, each event a map tagged with its
class name under "type"), so an external router that decodes vLLM's events decodes ours.
`--kv-events-config` (vLLM's JSON: `enable_kv_cache_events`, `publisher` "zmq" | "null",
`endpoint` (port + data-parallel rank), `topic`, ...) publishes them over a zmq PUB socket as
vLLM's `ZmqEventPublisher` does: frames (topic, 8-byte big-endian sequence number, payload).

The data-parallel router (`engine/dp_router.py`) reads the same batches from every core's step
output and keeps its own exact index of who holds which block.

NOTE: block hashes are published as unsigned 64-bit integers (vLLM's
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` form). They are this core's hashes, comparable between
events of one core only: Python's `hash()` of a salted chain's root differs between processes,
so consumers key blocks by their tokens and parents (as `dp_router.PrefixIndex` does), never by
comparing hashes across cores.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's medium for the device cache (ours: the KV pool, on any device)
_U64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `EventBatch`: a step's events, with the core's data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the KV cache events (tagged: "type" names the class)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: consecutive blocks of one chain."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # NOTE: no default: always encoded (vLLM's decoder requires the field)
    lora_name: str | None
    # vLLM's extra keys per block (ours: the request's cache_salt, once per block, or None)
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were dropped (handed out again for other contents)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes (typed decoding: never pickle)."""
    return _DECODER.decode(payload)


def external_hash(h: int) -> int:
    """A block hash as published: unsigned 64-bit."""
    return h & _U64


def split_salt(salt) -> tuple[int | None, str | None]:
    """(lora_id, cache_salt) of a sequence's prefix-cache salt (`lora.engine.cache_key`: the
    request's cache_salt, or ("lora", adapter id, cache_salt))."""
    if isinstance(salt, tuple) and len(salt) == 3 and salt[0] == "lora":
        return salt[1], salt[2]
    return None, salt


class KVEventSink:
    """What `KVCacheManager` calls (its `events` attribute; None: no events). Pure calls with
    plain values; the collector below is the one implementation."""

    def stored(self, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...],
               salt) -> None:
        """A full block entered the cache (`parent_hash` None: the first of its chain)."""

    def removed(self, block_hash: int) -> None:
        """A cached block was forgotten."""

    def cleared(self) -> None:
        """Every cached block was forgotten."""


class KVEventCollector(KVEventSink):
    """Collects one step's events in order (consecutive stores of one chain merged into one
    `BlockStored`, as vLLM emits a request's newly full blocks); `take` hands the batch out."""

    def __init__(self, block_size: int, data_parallel_rank: int = 0,
                 lora_names: dict[int, str] | None = None) -> None:
        self.block_size = block_size
        self.rank = data_parallel_rank
        # adapter id -> name, for `lora_name` (filled by the core as adapters arrive)
        self.lora_names = lora_names if lora_names is not None else {}
        self._events: list[Any] = []
        self._last_stored_hash: int | None = None

    def stored(self, block_hash, parent_hash, tokens, salt) -> None:
        h = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        lora_id, cache_salt = split_salt(salt)
        extra = None if cache_salt is None else (cache_salt,)
        last = self._events[-1] if self._events else None
        # NOTE: merged only when this block continues the previous event's chain with the same
        # adapter and salt: one event then reads as consecutive blocks.
        if (isinstance(last, BlockStored) and parent is not None
                and self._last_stored_hash == parent and last.lora_id == lora_id
                and (last.extra_keys or [None])[-1] == extra):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            if last.extra_keys is not None:
                last.extra_keys.append(extra)
        else:
            self._events.append(BlockStored(
                block_hashes=[h], parent_block_hash=parent, token_ids=list(tokens),
                block_size=self.block_size, lora_id=lora_id, medium=MEDIUM_GPU,
                lora_name=self.lora_names.get(lora_id) if lora_id is not None else None,
                extra_keys=None if extra is None else [extra]))
        self._last_stored_hash = h

    def removed(self, block_hash) -> None:
        h = external_hash(block_hash)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
        else:
            self._events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU))
        self._last_stored_hash = None

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())
        self._last_stored_hash = None

    def take(self) -> KVEventBatch | None:
        """The events since the last call as one batch (None when there were none)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        self._last_stored_hash = None
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)


# --- --kv-events-config ----------------------------------------------------------------------


@dataclass
class KVEventsConfig:
    """vLLM's `--kv-events-config` (its field names and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; default zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', "
                             f"got {self.publisher!r}")
        if self.enable_kv_cache_events and self.publisher == "zmq":
            offset_endpoint_port(self.endpoint, 0)  # ValueError on a malformed endpoint

    @classmethod
    def parse(cls, value) -> KVEventsConfig | None:
        """From a JSON string or a dict (None stays None); ValueError naming
        `kv_events_config` for anything malformed."""
        if value is None:
            return None
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"kv_events_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {unknown} (known: "
                             f"{sorted(names)})")
        return cls(**value)


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: data-parallel rank r publishes on the endpoint's port + r (inproc: a
    "_dp{r}" suffix)."""
    if not endpoint or rank == 0:
        if endpoint and not (endpoint.startswith("tcp://") or endpoint.startswith("inproc://")
                             or endpoint.startswith("ipc://")):
            raise ValueError(f"kv_events_config: endpoint {endpoint!r} is not tcp://, ipc:// "
                             "or inproc://")
        return endpoint
    if endpoint.startswith("inproc://") or endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        try:
            return f"{base}:{int(port) + rank}"
        except ValueError:
            raise ValueError(f"kv_events_config: endpoint {endpoint!r} has no port") from None
    raise ValueError(f"kv_events_config: endpoint {endpoint!r} is not tcp://, ipc:// or "
                     "inproc://")


class ZmqEventPublisher:
    """Publishes batches on a zmq PUB socket from a background thread, as vLLM's publisher:
    multipart (topic, sequence number as 8 big-endian bytes, msgpack payload). Binds when the
    endpoint has a wildcard (or is ipc / inproc), connects otherwise."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        if "*" in self.endpoint or "::" in self.endpoint or not self.endpoint.startswith("tcp"):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._topic = config.topic.encode()
        self._seq = count()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events queue full: a batch was dropped")

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            payload = encode_batch(batch)
            self._pub.send_multipart((self._topic, next(self._seq).to_bytes(8, "big"), payload))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=1.0)
        self._pub.close(linger=0)


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0):
    """A `ZmqEventPublisher`, or None when events are not published."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    return ZmqEventPublisher(config, data_parallel_rank)
