"""`pagedserve bench serve` against the real server on a tiny model: every request completes
with exactly the trace's output length, and the report has every figure."""

import pytest

pytestmark = pytest.mark.timeout(90)


def test_bench_serve_cli_runs_a_seeded_trace_with_poisson_arrivals(server, tiny_llama, capsys):
    from pagedserve.entrypoints.cli import main

    code = main(["bench", "serve", "--base-url", server.url, "--model", str(tiny_llama),
                 "--num-prompts", "6", "--output-len-fixed", "5", "--input-len-mean", "20",
                 "--max-input-len", "64", "--request-rate", "50", "--max-concurrency", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "requests: 6 ok, 0 failed" in out
    assert "output tokens: 30" in out
    for figure in ("request throughput:", "output token throughput:", "TTFT ms:", "TPOT ms:",
                   "ITL ms:", "normalized latency:"):
        assert figure in out
