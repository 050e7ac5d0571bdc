"""Prometheus metrics of the server, with vLLM's names under the `pagedserve:` prefix.

A dashboard built for vLLM maps one-to-one by replacing `vllm:` with `pagedserve:`, or unchanged
with `pagedserve serve --metrics-prefix vllm` (every name below under `vllm:`). Every metric
carries vLLM's `model_name` label. Each app owns its own `CollectorRegistry` (never the global
one), so several apps in one process do not clash.

| pagedserve                                   | vLLM equivalent                          |
| -------------------------------------------- | ---------------------------------------- |
| pagedserve:num_requests_running              | vllm:num_requests_running                |
| pagedserve:num_requests_waiting              | vllm:num_requests_waiting                |
| pagedserve:num_requests_swapped              | vllm:num_requests_swapped (vLLM v0)      |
| pagedserve:kv_cache_usage_perc (0..1)        | vllm:kv_cache_usage_perc (was gpu_...)   |
| pagedserve:kv_cache_group_usage_perc{group}  | (ours: per KV layer group, issue 36)     |
| pagedserve:kv_cache_group_waste_perc{group}  | (ours: held slots no query reads)        |
| pagedserve:num_preemptions_total             | vllm:num_preemptions_total               |
| pagedserve:prefix_cache_queries_total (tokens) | vllm:prefix_cache_queries_total        |
| pagedserve:prefix_cache_hits_total (tokens)  | vllm:prefix_cache_hits_total             |
| pagedserve:prompt_tokens_total               | vllm:prompt_tokens_total                 |
| pagedserve:generation_tokens_total           | vllm:generation_tokens_total             |
| pagedserve:request_success_total{finished_reason} | vllm:request_success_total          |
| pagedserve:time_to_first_token_seconds       | vllm:time_to_first_token_seconds         |
| pagedserve:time_per_output_token_seconds     | vllm:time_per_output_token_seconds       |
| pagedserve:inter_token_latency_seconds       | vllm:inter_token_latency_seconds         |
| pagedserve:e2e_request_latency_seconds       | vllm:e2e_request_latency_seconds         |
| pagedserve:request_queue_time_seconds        | vllm:request_queue_time_seconds          |
| pagedserve:request_prompt_tokens             | vllm:request_prompt_tokens               |
| pagedserve:request_generation_tokens         | vllm:request_generation_tokens           |
| pagedserve:iteration_tokens_total (histogram) | vllm:iteration_tokens_total             |
| pagedserve:num_requests_waiting_by_reason{reason} | vllm:num_requests_waiting_by_reason |
| pagedserve:cache_config_info (labels)        | vllm:cache_config_info                   |
| pagedserve:request_params_n                  | vllm:request_params_n                    |
| pagedserve:request_params_max_tokens         | vllm:request_params_max_tokens           |
| pagedserve:request_inference_time_seconds    | vllm:request_inference_time_seconds      |
| pagedserve:request_prefill_time_seconds      | vllm:request_prefill_time_seconds        |
| pagedserve:request_decode_time_seconds       | vllm:request_decode_time_seconds         |
| pagedserve:request_num_preemptions           | vllm:request_num_preemptions (v0)        |
| pagedserve:engine_steps_total                | (ours: engine iterations)                |
| pagedserve:spec_decode_num_drafts_total      | vllm:spec_decode_num_drafts_total        |
| pagedserve:spec_decode_num_draft_tokens_total | vllm:spec_decode_num_draft_tokens_total |
| pagedserve:spec_decode_num_accepted_tokens_total | vllm:spec_decode_num_accepted_tokens_total |
| pagedserve:spec_decode_num_accepted_tokens_per_pos_total{position} | vllm:spec_decode_num_accepted_tokens_per_pos_total |
| pagedserve:spec_decode_acceptance_rate       | (ours: accepted / draft tokens so far)   |
| pagedserve:spec_decode_mean_acceptance_length | (ours: 1 + accepted per draft so far)   |
| pagedserve:spec_decode_draft_time_share      | (ours: proposing's share of step time)   |

The speculative decoding counters stay at 0 on an engine without `--speculative-config`; vLLM's
acceptance rate is `rate(spec_decode_num_accepted_tokens_total) /
rate(spec_decode_num_draft_tokens_total)`, its mean acceptance length
`1 + rate(..._accepted_tokens_total) / rate(..._num_drafts_total)`.

`num_requests_waiting_by_reason` has vLLM's two reasons: `capacity` (every waiting request here)
and `deferred` (always 0: nothing here waits on a grammar compile or a remote KV transfer).

The prefix cache hit ratio is `rate(prefix_cache_hits_total) / rate(prefix_cache_queries_total)`,
as with vLLM's current metrics.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagedserve.engine.stats import FinishedRequestStats, StepStats

PREFIX = "pagedserve:"
# --metrics-prefix: ours, or vLLM's own (the same names, so vLLM's dashboards read them as is)
PREFIXES = ("pagedserve:", "vllm:")
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ServerMetrics:
    """The metrics of one server; a `StatsListener` of the async engine (thread-safe)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 prefix: str = PREFIX, engine: int | None = None) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.prefix = p = prefix
        self.registry = registry if registry is not None else CollectorRegistry()
        # With `engine` (data parallelism: one ServerMetrics per engine core over one registry),
        # every metric also carries vLLM's `engine` label; the metric families are shared.
        labels = ["model_name"] + ([] if engine is None else ["engine"])
        values = (model_name,) + (() if engine is None else (str(engine),))
        families = _families(self.registry)

        def family(kind, name, doc, names, **kwargs):
            metric = families.get(p + name)
            if metric is None:
                metric = families[p + name] = kind(p + name, doc, names, registry=self.registry,
                                                   **kwargs)
            return metric

        def gauge(name, doc):
            return family(Gauge, name, doc, labels).labels(*values)

        def counter(name, doc):
            return family(Counter, name, doc, labels).labels(*values)

        def histogram(name, doc, buckets):
            return family(Histogram, name, doc, labels, buckets=buckets).labels(*values)

        self.num_running = gauge("num_requests_running", "Requests being computed (running).")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.cpu_usage = gauge("cpu_cache_usage_perc",
                               "Fraction of CPU swap-pool blocks in use (0-1).")
        group_usage = family(Gauge, "kv_cache_group_usage_perc",
                             "Fraction of the KV pool's blocks a layer group holds (0-1).",
                             labels + ["group"])
        group_waste = family(Gauge, "kv_cache_group_waste_perc",
                             "Fraction of a layer group's held KV slots that no query reads "
                             "(empty slots of last blocks, slots behind a sliding window; 0-1).",
                             labels + ["group"])
        self.group_gauges = lambda name: (group_usage.labels(*values, name),
                                          group_waste.labels(*values, name))
        self.preemptions = counter("num_preemptions", "Preemptions (requests evicted).")
        by_mode = family(Counter, "num_preemptions_by_mode",
                         "Preemptions by recovery mode (recompute, swap).", labels + ["mode"])
        self.preemptions_by_mode = {m: by_mode.labels(*values, m)
                                    for m in ("recompute", "swap")}
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.steps = counter("engine_steps", "Engine iterations (one batch each).")
        success = family(Counter, "request_success", "Requests finished, by finish reason.",
                         labels + ["finished_reason"])
        self.finished = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self._success = success
        self._model_name = model_name
        self._values = values
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time between two output tokens of a request.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two output tokens of a request.", _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to end.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens (prompt + generated) per engine step.",
                                          _ITERATION_BUCKETS)
        by_reason = family(Gauge, "num_requests_waiting_by_reason",
                           "Requests waiting, by reason (capacity, deferred).", labels + ["reason"])
        self.waiting_by_reason = {reason: by_reason.labels(*values, reason)
                                  for reason in ("capacity", "deferred")}
        self.params_n = histogram("request_params_n", "The n (or best_of) of each request.",
                                  (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "The max_tokens of each request.", _TOKEN_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Request time from first scheduled to finish.",
                                        _REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Request time from first scheduled to first token.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Request time from first token to finish.", _REQUEST_BUCKETS)
        self.spec = _SpecMetrics(counter, gauge, family(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by position in the draft.", labels + ["position"]), values)
        self.request_preemptions = histogram("request_num_preemptions",
                                             "Preemptions of each finished request.",
                                             (0, 1, 2, 5, 10, 20))

    def set_cache_config(self, info: dict[str, object]) -> None:
        """`cache_config_info`: the KV cache's configuration as labels (value 1), as vLLM's."""
        if self.prefix + "cache_config_info" in _families(self.registry):
            return  # (one per registry: the engine cores of a data-parallel server share it)
        _families(self.registry)[self.prefix + "cache_config_info"] = None
        labels = {k: str(v) for k, v in info.items()}
        Gauge(self.prefix + "cache_config_info", "Information of the KV cache configuration.",
              list(labels), registry=self.registry).labels(**labels).set(1)

    def on_step(self, stats: StepStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        self.steps.inc(stats.steps)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generation_tokens)
        self.preemptions.inc(stats.preemptions)
        self.cpu_usage.set(stats.cpu_kv_usage)
        for name, use, waste in stats.kv_groups:
            usage_gauge, waste_gauge = self.group_gauges(name)
            usage_gauge.set(use)
            waste_gauge.set(waste)
        for mode, count in stats.preemptions_by_mode.items():
            if mode in self.preemptions_by_mode:
                self.preemptions_by_mode[mode].inc(count)
        self.waiting_by_reason["capacity"].set(stats.num_waiting)
        self.waiting_by_reason["deferred"].set(0)
        if stats.steps:
            self.iteration_tokens.observe(stats.prompt_tokens + stats.generation_tokens)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        if stats.spec_totals is not None:
            self.spec.update(stats.spec_totals)
        for value in stats.time_to_first_token:
            self.ttft.observe(value)
        for value in stats.inter_token_latency:
            self.tpot.observe(value)
            self.itl.observe(value)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        counter = self.finished.get(stats.finish_reason)
        if counter is None:
            counter = self._success.labels(*self._values, stats.finish_reason)
        counter.inc()
        self.e2e.observe(stats.e2e_latency)
        if stats.queue_time is not None:
            self.queue_time.observe(stats.queue_time)
        self.request_prompt_tokens.observe(stats.prompt_tokens)
        self.request_generation_tokens.observe(stats.generation_tokens)
        self.params_n.observe(stats.n)
        if stats.max_tokens is not None:
            self.params_max_tokens.observe(stats.max_tokens)
        self.request_preemptions.observe(stats.num_preemptions)
        for histogram, value in ((self.inference_time, stats.inference_time),
                                 (self.prefill_time, stats.prefill_time),
                                 (self.decode_time, stats.decode_time)):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def _families(registry: CollectorRegistry) -> dict:
    """The metric families made in `registry` by ServerMetrics objects, by name (shared by the
    per-engine ServerMetrics of a data-parallel server)."""
    families = getattr(registry, "_pagedserve_families", None)
    if families is None:
        families = registry._pagedserve_families = {}
    return families


class EngineMetrics:
    """The metrics of a server over several engine cores: one `ServerMetrics` per core over one
    registry, every series labelled with vLLM's `engine` (its index); step and request records
    go to their core's (`StepStats.engine`, `FinishedRequestStats.engine`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, num_engines: int, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry()
        self.per_engine = [ServerMetrics(model_name, self.registry, prefix, engine=i)
                           for i in range(num_engines)]
        self.prefix = prefix

    def set_cache_config(self, info: dict[str, object]) -> None:
        self.per_engine[0].set_cache_config(info)

    def on_step(self, stats: StepStats) -> None:
        self.per_engine[stats.engine].on_step(stats)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        self.per_engine[stats.engine].on_request_finished(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecMetrics:
    """Speculative decoding's counters (vLLM's names) and our rate gauges, fed the engine's
    cumulative totals (`StepStats.spec_totals`): each update adds what grew since the last."""

    def __init__(self, counter, gauge, per_pos: Counter, values: tuple[str, ...]) -> None:
        self.drafts = counter("spec_decode_num_drafts", "Drafts verified (one per row).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.acceptance_rate = gauge("spec_decode_acceptance_rate",
                                     "Accepted draft tokens / draft tokens, so far.")
        self.mean_length = gauge("spec_decode_mean_acceptance_length",
                                 "1 + accepted draft tokens per draft, so far.")
        self.draft_share = gauge("spec_decode_draft_time_share",
                                 "Share of the engine's step time spent proposing drafts.")
        self._per_pos = per_pos
        self._values = values
        self._last = (0, 0, 0, (), 0.0, 0.0)

    def update(self, totals: tuple) -> None:
        drafts, draft_tokens, accepted, per_pos, draft_s, step_s = totals
        last = self._last
        self.drafts.inc(drafts - last[0])
        self.draft_tokens.inc(draft_tokens - last[1])
        self.accepted.inc(accepted - last[2])
        for pos, count in enumerate(per_pos):
            before = last[3][pos] if pos < len(last[3]) else 0
            if count > before:
                self._per_pos.labels(*self._values, str(pos)).inc(count - before)
        if draft_tokens:
            self.acceptance_rate.set(accepted / draft_tokens)
        if drafts:
            self.mean_length.set(1 + accepted / drafts)
        if step_s:
            self.draft_share.set(draft_s / step_s)
        self._last = totals
