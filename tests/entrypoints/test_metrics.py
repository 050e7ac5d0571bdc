"""GET /metrics: Prometheus text with vLLM's metric names under `pagedserve:`, counting what the
engine did."""

import pytest

from server_utils import metric

pytestmark = pytest.mark.timeout(60)

NAMES = [
    "pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
    "pagedserve:num_requests_swapped", "pagedserve:kv_cache_usage_perc",
    "pagedserve:num_preemptions_total", "pagedserve:prompt_tokens_total",
    "pagedserve:generation_tokens_total", "pagedserve:prefix_cache_queries_total",
    "pagedserve:prefix_cache_hits_total", "pagedserve:engine_steps_total",
    "pagedserve:time_to_first_token_seconds_count",
    "pagedserve:time_per_output_token_seconds_count",
    "pagedserve:inter_token_latency_seconds_count",
    "pagedserve:e2e_request_latency_seconds_count",
    "pagedserve:request_queue_time_seconds_count",
    "pagedserve:request_prompt_tokens_count", "pagedserve:request_generation_tokens_count",
]


def test_metrics_use_vllm_names_under_our_prefix_with_the_model_label(http, server):
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    for name in NAMES:
        metric(resp.text, name, model_name=server.model)
    for reason in ("stop", "length", "abort"):
        metric(resp.text, "pagedserve:request_success_total", model_name=server.model,
               finished_reason=reason)


def test_a_request_moves_the_counters_and_histograms_by_what_it_did(http, server):
    def snapshot():
        text = http.get("/metrics").text
        return {name: metric(text, name) for name in NAMES} | {
            "length": metric(text, "pagedserve:request_success_total",
                             finished_reason="length")}

    before = snapshot()
    resp = http.post("/v1/completions", json={"prompt": "The function returns the", "max_tokens":
                                              7, "ignore_eos": True, "temperature": 0}).json()
    after = snapshot()

    def delta(name):
        return after[name] - before[name]

    assert delta("pagedserve:generation_tokens_total") == 7
    assert delta("pagedserve:request_generation_tokens_count") == 1
    assert delta("length") == 1
    assert delta("pagedserve:time_to_first_token_seconds_count") == 1
    assert delta("pagedserve:e2e_request_latency_seconds_count") == 1
    assert delta("pagedserve:request_queue_time_seconds_count") == 1
    assert delta("pagedserve:inter_token_latency_seconds_count") == 6
    assert delta("pagedserve:time_per_output_token_seconds_count") == 6
    assert delta("pagedserve:engine_steps_total") >= 7
    # Prompt tokens computed: at most the prompt (fewer if some were found in a prefix cache).
    assert 1 <= delta("pagedserve:prompt_tokens_total") <= resp["usage"]["prompt_tokens"]
    assert after["pagedserve:num_requests_running"] == 0
    assert after["pagedserve:kv_cache_usage_perc"] == 0


def test_preemptions_by_mode_and_cpu_pool_usage_are_exported_and_logged(caplog):
    import logging

    from pagedserve.engine.stats import StatsLogLine, StepStats
    from pagedserve.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    stats = StepStats(now=0.0, num_running=1, num_waiting=0, kv_usage=0.5, num_used_blocks=4,
                      num_blocks=8, num_swapped=2, steps=1, preemptions=3,
                      cpu_kv_usage=0.25, preemptions_by_mode={"recompute": 1, "swap": 2})
    m.on_step(stats)
    text = m.render().decode()
    assert metric(text, "pagedserve:num_preemptions_by_mode_total", model_name="tiny",
                  mode="swap") == 2
    assert metric(text, "pagedserve:num_preemptions_by_mode_total", model_name="tiny",
                  mode="recompute") == 1
    assert metric(text, "pagedserve:cpu_cache_usage_perc", model_name="tiny") == 0.25
    import time

    line = StatsLogLine(interval=1.0)
    with caplog.at_level(logging.INFO, logger="pagedserve.stats"):
        line.on_step(stats)
        line.log_if_due(time.monotonic() + 2.0)
    assert "swapped: 2 reqs" in caplog.text and "1 recompute / 2 swap" in caplog.text
    assert "CPU swap blocks in use: 25.0%" in caplog.text
