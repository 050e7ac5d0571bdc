"""What travels between the front end and an engine core: msgspec structs, msgpack frames.

Front end -> core (one message per frame, tagged by type): `CoreRequest` (a tokenized request:
token ids, resolved `SamplingParams`, adapter, priority), `CoreAbort`, `CoreStopSeqs` (sequences
the front end stopped on a stop string), `CoreUtility` (a named call from a fixed list, never
code), `CoreShutdown`.

Core -> front end: one `CoreOutputs` per step (or per batch of commands while idle): the
engine's index, the requests it accepted or refused (with the refusal's message), per request
that advanced a `RequestDelta` (new tokens and raw logprobs per sequence, finish reasons,
timings), the step's `CoreStats` (load, for routing and metrics), its KV events, utility results.
A core that fails a request's step reports it in `failed`.

NOTE: frames are decoded with typed msgspec decoders only: nothing from a socket is ever
unpickled or executed. `SamplingParams` / `LoRARequest` / `PoolingParams` decode through their
dataclasses (their `__post_init__` checks run again in the core).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedserve.engine.kv_events import KVEventBatch
from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


class CoreRequest(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One tokenized request for a core (text stays in the front end)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    arrival_time: float = 0.0
    priority: int = 0
    lora_request: LoRARequest | None = None
    # validate only: the core answers accepted / refused and queues nothing
    validate_only: bool = False


class CoreAbort(msgspec.Struct, tag=True, gc=False):
    request_ids: list[str]


class CoreStopSeqs(msgspec.Struct, tag=True, gc=False):
    """(request id, sequence index) pairs the front end stopped (a stop string matched): each
    ends at its next token in the core."""

    seqs: list[tuple[str, int]]


class CoreUtility(msgspec.Struct, tag=True, gc=False):
    """A call of one of `core_proc.UTILITY_METHODS` with plain arguments."""

    call_id: int
    method: str
    args: list[Any] = []


class CoreShutdown(msgspec.Struct, tag=True, gc=False):
    pass


CoreInput = CoreRequest | CoreAbort | CoreStopSeqs | CoreUtility | CoreShutdown


class SeqDelta(msgspec.Struct, array_like=True, gc=False):
    """One sequence's progress in a step: its new tokens, each token's sample logprob (for the
    cumulative logprob; None without logprobs), its new logprob entries (raw: token, logprob,
    rank, top [(id, logprob)...]) when asked, and its finish once it finished."""

    index: int
    token_ids: list[int]
    sample_logprobs: list[float | None] | None = None
    logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class BeamHyp(msgspec.Struct, array_like=True, gc=False):
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None = None


class RequestDelta(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One request's progress in a step."""

    request_id: str
    seqs: list[SeqDelta] = []
    finished: bool = False
    # raw prompt logprobs of the positions computed this step: (token, logprob, rank, top), or
    # None (the first position's)
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]] | None] | None = None
    beams: list[BeamHyp] | None = None  # a beam search: its current (or final) hypotheses
    pooled: tuple[bytes, list[int], str] | None = None  # (float32 bytes, shape, dtype)
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """A core's state after a step (for routing and per-engine metrics); the counters are
    cumulative (the front end takes differences)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    num_used_blocks: int
    num_blocks: int
    cpu_kv_usage: float
    steps: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    # the routing load: tokens of the waiting requests still to compute + running tokens
    load_tokens: int
    preemptions_by_mode: dict[str, int] = {}


class CoreOutputs(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, tag=True):
    engine_index: int
    deltas: list[RequestDelta] = []
    accepted: list[str] = []
    refused: list[tuple[str, str]] = []  # (request id, ValueError message)
    failed: list[tuple[str, str]] = []  # (request id, error): its step raised in the core
    stats: CoreStats | None = None
    kv_events: KVEventBatch | None = None
    utility: list[tuple[int, bool, Any]] = []  # (call id, ok, result or error message)


class CoreReady(msgspec.Struct, array_like=True, gc=False, tag=True):
    """The core's handshake: what the front end needs to know of the engine it started."""

    engine_index: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    num_cpu_blocks: int
    eos_token_ids: list[int]
    runner: str
    pid: int
    node: str = ""


_input_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(type=CoreInput)
_output_decoder = msgspec.msgpack.Decoder(type=CoreOutputs | CoreReady)


def encode(msg) -> bytes:
    return _input_encoder.encode(msg)


def decode_input(frame: bytes):
    """A front end -> core frame (typed; never pickle)."""
    return _input_decoder.decode(frame)


def decode_output(frame: bytes):
    """A core -> front end frame: `CoreOutputs` or `CoreReady` (typed; never pickle)."""
    return _output_decoder.decode(frame)
