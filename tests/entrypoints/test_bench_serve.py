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


def test_bench_serve_profile_reports_server_side_sections_and_writes_json(tiny_llama, logs,
                                                                          tmp_path, capsys):
    import json

    from server_utils import SERVER_FLAGS, ServerProcess

    from pagedserve.entrypoints.cli import main

    proc = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, "--enable-debug-endpoints",
                               log_dir=logs)
    try:
        out_json = tmp_path / "result.json"
        code = main(["bench", "serve", "--base-url", proc.url, "--model", str(tiny_llama),
                     "--num-prompts", "4", "--output-len-fixed", "4", "--input-len-mean", "12",
                     "--max-input-len", "32", "--profile", "--result-json", str(out_json),
                     "--extra-body", '{"cache_prompt": false}'])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "server-side profile, all steps" in out and "outside steps" in out
        result = json.loads(out_json.read_text())
        assert result["num_ok"] == 4 and result["output_tokens"] == 16
        assert result["profile"]["attention"] > 0 and result["profile"]["outside steps"] >= 0
        # Stopping twice is a clear 400, not a crash.
        import httpx

        resp = httpx.post(proc.url + "/debug/profile/stop")
        assert resp.status_code == 400 and "profile/start" in resp.json()["error"]["message"]
    finally:
        assert proc.stop() == 0, proc.log_text()[-3000:]
