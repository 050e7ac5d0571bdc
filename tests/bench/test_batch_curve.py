"""The batch-size curve (issue 40) renders from a saved results.json: medians per engine and C,
per-round ratios, growth, "-" where an engine has no run, and a PNG -- no engine is started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.bench import batch_curve

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
OURS, VLLM, LLAMA = "pagedserve avx2:gguf", "vLLM CPU", "llama-server q4km"
KINDS = {OURS: "ours", VLLM: "vllm", LLAMA: "llama-server"}


def _row(engine, c, rnd, tok_s, exact=True):
    """One row as bench_vs_peers writes it (the fields the curve reads, plus a few it ignores)."""
    row = {"engine": engine, "kind": KINDS[engine], "concurrency": c, "round": rnd,
           "output_throughput": tok_s, "ttft_p50_ms": 100.0, "tpot_p50_ms": 10.0,
           "exact_lengths": exact, "idle_rss_mib": 600.0, "peak_rss_mib": 700.0,
           "cpu": "AMD EPYC 7B13", "outputs": [],
           "path": "avx2 path, gguf weights" if engine == OURS else "peer"}
    if engine == OURS:
        row["isa_path"] = "avx2"
    return row


def _rows():
    """Three rounds at C=1 and 16; at C=64 vLLM failed (no rows) and llama-server ran once; one
    llama-server run at C=16 came back short."""
    ours = {1: (40.0, 50.0, 45.0), 16: (160.0, 150.0, 170.0), 64: (200.0, 210.0, 190.0)}
    vllm = {1: (20.0, 10.0, 30.0), 16: (80.0, 100.0, 50.0)}
    llama = {1: (40.0, 40.0, 40.0), 16: (80.0, 75.0, 85.0), 64: (100.0,)}
    rows = []
    for engine, table in ((OURS, ours), (VLLM, vllm), (LLAMA, llama)):
        for c, values in table.items():
            rows += [_row(engine, c, rnd, v, exact=not (engine == LLAMA and c == 16 and rnd == 2))
                     for rnd, v in enumerate(values, 1)]
    return rows


def _cells(table: str, c: int) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {c} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_table_gives_medians_round_ratios_growth_and_dashes():
    rows = _rows()
    table = batch_curve.curve_table(rows, batch_curve.CURVE_CONCURRENCY)
    header = [cell.strip() for cell in table.splitlines()[0].strip("|").split("|")]
    assert header == ["C", OURS, VLLM, LLAMA, f"ours / {VLLM}", f"ours / {LLAMA}"]
    # Medians over rounds; ratios are the median of the rounds' ratios (C=1 vs vLLM: 2, 5, 1.5
    # -> 2.00x, where the ratio of the medians would be 2.25x).
    assert _cells(table, 1) == ["1", "45.0", "20.0", "40.0", "2.00x", "1.12x"]
    assert _cells(table, 16) == ["16", "160.0", "80.0", "80.0*", "2.00x", "2.00x"]
    # vLLM has no run at 64 and nobody ran 4 or 128: "-", not a crash.
    assert _cells(table, 64) == ["64", "200.0", "-", "100.0", "-", "2.00x"]
    assert _cells(table, 4) == ["4", "-", "-", "-", "-", "-"]
    assert _cells(table, 128) == ["128", "-", "-", "-", "-", "-"]
    assert batch_curve.growth(rows, OURS) == pytest.approx(200.0 / 160.0)
    assert batch_curve.growth(rows, VLLM) is None
    text = batch_curve.report(rows)
    assert f"{OURS} 1.25x, {VLLM} -, {LLAMA} 1.25x" in text
    assert ("CPU: AMD EPYC 7B13; output tokens/s, medians over rounds "
            "(most rounds at each C: C=1 3, C=16 3, C=64 3)") in text
    assert f"{OURS}: ISA path avx2; avx2 path, gguf weights\n{VLLM}: peer\n" in text
    assert "* some requests" in text


def test_two_of_our_configs_get_a_ratio_column_each_and_old_rows_say_not_recorded():
    rows = [_row(OURS, 16, 1, 100.0), _row(VLLM, 16, 1, 50.0)]
    other = dict(rows[0], engine="pagedserve avx512bf16:gguf", output_throughput=150.0)
    for r in rows + [other]:  # rows written before --curve recorded these
        r.pop("cpu"), r.pop("isa_path", None)
    table = batch_curve.curve_table(rows + [other])
    assert f"| {OURS} / {VLLM} | pagedserve avx512bf16:gguf / {VLLM} |" in table
    assert _cells(table, 16)[-2:] == ["2.00x", "3.00x"]
    text = batch_curve.describe(rows + [other])
    assert text.startswith("CPU: not recorded") and f"{OURS}: ISA path not recorded" in text


def test_from_results_renders_the_table_and_the_png_without_engines(tmp_path):
    pytest.importorskip("matplotlib")
    # The curve run in two parts (by concurrency), rendered together.
    low, high = tmp_path / "low.json", tmp_path / "high.json"
    low.write_text(json.dumps([r for r in _rows() if r["concurrency"] < 64]))
    high.write_text(json.dumps([r for r in _rows() if r["concurrency"] >= 64]))
    plot = tmp_path / "figures" / "curve.png"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vs_peers.py"),
                          "--from-results", str(low), str(high), "--plot", str(plot)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "| 16 | 160.0 | 80.0 | 80.0* | 2.00x | 2.00x |" in res.stdout
    assert "| 64 | 200.0 | - | 100.0 | - | 2.00x |" in res.stdout
    assert f"Growth C=64 / C=16 (median tok/s): {OURS} 1.25x" in res.stdout
    assert plot.read_bytes().startswith(PNG)


def test_the_plot_defaults_beside_the_results_not_over_the_docs_figure(tmp_path):
    pytest.importorskip("matplotlib")
    # A curve of another model must not overwrite docs/figures/batch_curve.png unless asked.
    docs_figure = ROOT / "docs" / "figures" / "batch_curve.png"
    before = docs_figure.read_bytes() if docs_figure.exists() else None
    results = tmp_path / "run" / "results.json"
    results.parent.mkdir()
    results.write_text(json.dumps(_rows()))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vs_peers.py"),
                          "--from-results", str(results)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "run" / "batch_curve.png").read_bytes().startswith(PNG)
    assert (docs_figure.read_bytes() if docs_figure.exists() else None) == before
