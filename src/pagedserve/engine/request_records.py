"""What the async front ends record of each request's outputs for the metrics (`engine.stats`):
its first-token and inter-token waits as tokens arrive, and its `FinishedRequestStats` when it
leaves. Shared by the in-process engine (`engine.async_engine`) and the front end of engine
cores in their own processes (`engine.async_mp_engine`); the trackers are theirs: any object
with `arrival_time`, `last_token_time`, `num_tokens`, `params` and optionally `engine`."""

from __future__ import annotations

from pagedserve.engine.stats import FinishedRequestStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


def completions(out) -> list:
    """A RequestOutput's completions; none for a pooling request's output."""
    return out.outputs if isinstance(out.outputs, list) else []


def note_tokens(tracked, out, now: float, ttft: list, itl: list) -> None:
    """Advance `tracked` (its `num_tokens`, `last_token_time`, `arrival_time`) to `out`'s token
    count; when `out` brought new tokens, the wait goes to `ttft` (the first) or `itl`."""
    num_tokens = sum(len(c.token_ids) for c in completions(out))
    if num_tokens > tracked.num_tokens:
        if tracked.last_token_time is None:
            ttft.append(now - tracked.arrival_time)
        else:
            itl.append(now - tracked.last_token_time)
        tracked.last_token_time = now
        tracked.num_tokens = num_tokens


def request_timings(out: RequestOutput, tracked, now: float) -> dict:
    """A finished request's n, max_tokens, preemptions and its inference / prefill / decode
    times (vLLM's per-request metrics)."""
    params, m = tracked.params, out.metrics
    record: dict = {"num_preemptions": out.num_preemptions}
    if isinstance(params, SamplingParams):
        record["n"] = max(params.n, params.best_of or 0)
        record["max_tokens"] = params.max_tokens
    if m is not None and m.first_scheduled_time is not None:
        end = m.finished_time or now
        record["inference_time"] = end - m.first_scheduled_time
        if m.first_token_time is not None:
            record["prefill_time"] = m.first_token_time - m.first_scheduled_time
            record["decode_time"] = end - m.first_token_time
    return record


def finished_record(out: RequestOutput, tracked, now: float) -> FinishedRequestStats:
    """The record of a request whose last output is `out` (a pooling request that finished
    counts as "stop", as vLLM records it; no finish reason at all as "abort")."""
    reasons = [c.finish_reason for c in completions(out) if c.finish_reason]
    if out.finished and not isinstance(out.outputs, list):
        reasons = ["stop"]
    m = out.metrics
    return FinishedRequestStats(
        request_id=out.request_id, finish_reason=reasons[0] if reasons else "abort",
        prompt_tokens=len(out.prompt_token_ids), generation_tokens=tracked.num_tokens,
        e2e_latency=now - tracked.arrival_time,
        queue_time=(m.first_scheduled_time - tracked.arrival_time)
        if m is not None and m.first_scheduled_time is not None else None,
        engine=getattr(tracked, "engine", 0), **request_timings(out, tracked, now))
