"""`pagedserve bench paper`: Poisson arrivals, the sustainable-rate read-out, and a short smoke
run of the command on a tiny model (files written, every point finished)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiny

from pagedserve.bench.paper import (
    PointResult,
    make_setup,
    poisson_arrivals,
    sustainable_rate,
)
from pagedserve.entrypoints.cli import main


def test_poisson_arrivals_are_seeded_sorted_and_near_the_rate():
    a = poisson_arrivals(5.0, 200.0, seed=1)
    assert a == poisson_arrivals(5.0, 200.0, seed=1) and a == sorted(a)
    assert 900 < len(a) < 1100 and a[-1] < 200.0
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, seed=1)


def test_setup_scales_the_papers_max_model_len_and_budget_together():
    s = make_setup("sharegpt", 0.125, 16, None)
    assert (s.max_model_len, s.kv_tokens, s.num_kv_blocks) == (256, 1920, 120)
    assert make_setup("alpaca", 1.0, 16, None).max_model_len == 2048
    with pytest.raises(ValueError):
        make_setup("sharegpt", 2.0, 16, None)
    with pytest.raises(ValueError):
        make_setup("sharegpt", 0.125, 16, 100)  # budget below max_model_len


def _point(rate, lat, capped=False):
    return PointResult("sharegpt", "paged", rate, 1, 1, 1.0, lat, 1.0, 1.0, 1.0, 1, 1.0, 1.0,
                       capped)


def test_sustainable_rate_interpolates_where_latency_crosses_the_target():
    pts = [_point(1, 0.1), _point(2, 0.2), _point(3, 0.6)]
    rate, exact = sustainable_rate(pts, 0.4)
    assert exact and rate == pytest.approx(2.5)
    assert sustainable_rate(pts, 1.0) == (3, False)  # never crossed: a lower bound
    assert sustainable_rate(pts, 0.05) == (0.0, False)
    # A point that could not finish its requests is over any target.
    assert sustainable_rate([_point(1, 0.1), _point(2, 0.15, capped=True)], 1.0) == (1, True)


def test_bench_paper_smoke_run_writes_table_json_and_charts(tmp_path_factory, capsys):
    model = tiny.make_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")
    out = tmp_path_factory.mktemp("paper")
    rc = main(["bench", "paper", "--model", str(model), "--dtype", "float32", "--trace",
               "alpaca", "--rates", "4", "8", "--duration-s", "1", "--max-point-s", "30",
               "--length-scale", "0.0625", "--allocators", "paged", "contiguous-max",
               "--output-dir", str(out)])
    assert rc == 0
    points = json.loads((out / "results.json").read_text())
    assert {(p["allocator"], p["rate"]) for p in points} == {
        (a, r) for a in ("paged", "contiguous-max") for r in (4.0, 8.0)}
    assert all(p["finished"] == p["requests"] and not p["capped"] for p in points)
    for name in ("table.txt", "normalized_latency.png", "batch_size.png"):
        assert (out / name).stat().st_size > 0
    assert "sustainable request rate" in capsys.readouterr().out

    # Extending the sweep: one more rate, merged with the first run's points.
    more = tmp_path_factory.mktemp("paper-more")
    rc = main(["bench", "paper", "--model", str(model), "--dtype", "float32", "--trace",
               "alpaca", "--rates", "12", "--duration-s", "1", "--max-point-s", "30",
               "--length-scale", "0.0625", "--allocators", "paged", "contiguous-max",
               "--output-dir", str(more), "--merge", str(out / "results.json")])
    assert rc == 0
    merged = json.loads((more / "results.json").read_text())
    assert sorted((p["allocator"], p["rate"]) for p in merged) == sorted(
        (a, r) for a in ("paged", "contiguous-max") for r in (4.0, 8.0, 12.0))


def test_bench_paper_refuses_sharing_with_contiguous_allocators(capsys):
    assert main(["bench", "paper", "--n", "2", "--allocators", "contiguous-oracle"]) == 2
    assert "only --allocators paged" in capsys.readouterr().err
