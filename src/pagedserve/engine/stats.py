"""What the async engine reports after every step and every finished request, and the periodic
stats log line built from it.

The engine thread fills these records; listeners (Prometheus metrics, the log line) consume them
in that thread, so a listener must be thread-safe with respect to its own readers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("pagedserve.stats")


@dataclass
class StepStats:
    """The engine's state after a step (or after adds/aborts were applied while idle), and what
    changed since the previous record."""

    now: float  # time.monotonic()
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_used_blocks: int
    num_blocks: int
    num_swapped: int = 0  # requests swapped out to CPU blocks
    cpu_kv_usage: float = 0.0  # fraction of the CPU swap pool's blocks in use, 0..1
    # Preemptions since the previous record, by recovery mode ("recompute", "swap").
    preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    steps: int = 0  # engine steps since the previous record (0 or 1)
    prompt_tokens: int = 0  # prompt tokens computed since the previous record
    generation_tokens: int = 0  # tokens generated since the previous record
    preemptions: int = 0  # preemptions since the previous record
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since then
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Per request that produced its first token this step: arrival -> first token (seconds).
    time_to_first_token: list[float] = field(default_factory=list)
    # Per request that produced a later token this step: time since its previous token.
    inter_token_latency: list[float] = field(default_factory=list)
    # Speculative decoding's cumulative counters (`core.spec_decode.SpecDecoder.totals`), or
    # None when the engine does not speculate.
    spec_totals: tuple | None = None
    # A model of several KV layer groups (or a sliding window): per group (name, fraction of
    # the pool's blocks it holds, fraction of its held slots no query reads); else empty.
    kv_groups: list[tuple[str, float, float]] = field(default_factory=list)
    # The engine core this record is of (data parallelism: vLLM's `engine` label), 0 with one.
    engine: int = 0


@dataclass
class FinishedRequestStats:
    """One request that left the engine: finished, stopped, or aborted."""

    request_id: str
    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    generation_tokens: int
    e2e_latency: float  # arrival -> finish (seconds)
    queue_time: float | None  # arrival -> first scheduled; None if it never ran
    # vLLM's per-request metrics (None / 0 when unknown, e.g. an abort before running)
    n: int = 1  # sequences asked for (best_of when larger)
    max_tokens: int | None = None
    num_preemptions: int = 0
    inference_time: float | None = None  # first scheduled -> finish
    prefill_time: float | None = None  # first scheduled -> first token
    decode_time: float | None = None  # first token -> finish
    engine: int = 0  # the engine core that ran it (data parallelism), 0 with one


class StatsListener(Protocol):
    """Receives the engine thread's records (called in the engine thread)."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, stats: FinishedRequestStats) -> None: ...


class StatsLogLine:
    """Logs one line every `interval` seconds while the engine is busy: running / waiting
    requests, KV blocks in use, prompt and generation throughput; one last line once it idles."""

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"log_stats_interval must be > 0, got {interval}")
        self.interval = interval
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preempt = {"recompute": 0, "swap": 0}  # since the last line
        self._last: StepStats | None = None
        self._active = False  # something happened since the last line

    def on_step(self, stats: StepStats) -> None:
        self._prompt_tokens += stats.prompt_tokens
        self._generation_tokens += stats.generation_tokens
        for mode, count in stats.preemptions_by_mode.items():
            self._preempt[mode] = self._preempt.get(mode, 0) + count
        self._last = stats
        if stats.steps:
            self._active = True
        self.log_if_due(stats.now)

    def next_deadline(self) -> float | None:
        """When the next line is due (time.monotonic), or None when there is nothing to log."""
        return self._last_log + self.interval if self._active else None

    def log_if_due(self, now: float) -> None:
        if not self._active or now - self._last_log < self.interval or self._last is None:
            return
        elapsed = now - self._last_log
        s = self._last
        logger.info(
            "running: %d reqs, waiting: %d reqs, swapped: %d reqs, KV blocks in use: %.1f%% "
            "(%d/%d), CPU swap blocks in use: %.1f%%, preemptions: %d recompute / %d swap, "
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s",
            s.num_running, s.num_waiting, s.num_swapped, 100.0 * s.kv_usage, s.num_used_blocks,
            s.num_blocks, 100.0 * s.cpu_kv_usage, self._preempt["recompute"],
            self._preempt["swap"], self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
        )
        if s.kv_groups:
            logger.info("KV blocks in use by layer group: %s", ", ".join(
                f"{name} {100.0 * use:.1f}% (waste {100.0 * waste:.1f}%)"
                for name, use, waste in s.kv_groups))
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
        self._preempt = {"recompute": 0, "swap": 0}
        self._active = bool(s.num_running or s.num_waiting or s.num_swapped)
