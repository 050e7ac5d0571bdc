"""`pagedserve bench serve`'s statistics (the run against a server is in
tests/entrypoints/test_bench_serve.py)."""

import math

import pytest

from pagedserve.bench.serve import BenchResult, RequestResult, percentile


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))


def test_normalized_latency_is_the_mean_of_latency_per_output_token():
    results = [RequestResult(True, output_tokens=4, latency=2.0, ttft=0.5),
               RequestResult(True, output_tokens=10, latency=1.0, ttft=0.1),
               RequestResult(False, "HTTP 503")]
    bench = BenchResult(duration=2.0, results=results, request_rate=math.inf,
                        max_concurrency=None)
    assert bench.normalized_latency == pytest.approx((0.5 + 0.1) / 2)
    assert bench.num_failed == 1 and bench.request_throughput == 1.0
    assert bench.output_throughput == 7.0
    assert results[0].tpot == pytest.approx(0.5)
