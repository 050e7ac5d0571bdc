"""`pagedserve bench latency`: the fixed-batch benchmark and its roofline report, on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve.bench.latency import (
    LatencyResult,
    Roofline,
    model_sizes,
    random_prompts,
)
from pagedserve.entrypoints.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_lazy_imports import write_llama_config


def test_decode_figures_from_latency_and_prefill():
    r = LatencyResult(batch_size=8, input_len=16, output_len=11, latencies=[1.2, 1.0, 1.1],
                      prefill_s=0.1)
    assert r.mean_s == pytest.approx(1.1)
    assert r.decode_step_s == pytest.approx(0.1)  # (1.1 - 0.1) / 10 steps
    assert r.decode_tokens_per_s == pytest.approx(80.0)
    assert r.percentile(50) == pytest.approx(1.1)
    assert any("decode" in line for line in r.lines())


def test_roofline_bounds():
    roof = Roofline(num_params=8_000_000_000, weight_bytes=16_000_000_000, batch_size=256,
                    step_s=0.02, bandwidth=4.8e12, peak_tflops=790.0)
    assert roof.bandwidth_bound_s == pytest.approx(16e9 / 4.8e12)
    assert roof.bandwidth_fraction == pytest.approx((16e9 / 4.8e12) / 0.02)
    assert roof.achieved_tflops == pytest.approx(2 * 8e9 * 256 / 0.02 / 1e12)
    assert roof.compute_fraction == pytest.approx(roof.achieved_tflops / 790)
    assert "bandwidth roofline" in "\n".join(roof.lines())


def test_model_sizes_leave_out_embedding_tables_unless_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3, bias=False))
    assert model_sizes(model) == (12, 48)
    assert model_sizes(model, tied_embeddings=True) == (52, 208)


def test_random_prompts_are_seeded_and_in_vocabulary():
    a = random_prompts(3, 5, 100, seed=1)
    assert a == random_prompts(3, 5, 100, seed=1) != random_prompts(3, 5, 100, seed=2)
    assert all(len(p["prompt_token_ids"]) == 5 for p in a)
    assert all(4 <= t < 100 for p in a for t in p["prompt_token_ids"])


def test_bench_latency_runs_a_dummy_model(tmp_path, capsys):
    model = write_llama_config(tmp_path / "m")
    rc = main(["bench", "latency", "--model", str(model), "--load-format", "dummy",
               "--dtype", "float32", "--batch-size", "3", "--input-len", "5",
               "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
               "--kv-cache-memory", str(1 << 22), "--bandwidth", "1e11", "--peak-tflops", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "batch 3, input 5, output 4: 2 runs" in out
    for word in ("latency: mean", "prefill:", "decode:", "tok/s", "bandwidth roofline",
                 "% of peak"):
        assert word in out, out


def test_bench_latency_profile_kernels_prints_the_top_ops(tmp_path, capsys):
    model = write_llama_config(tmp_path / "m")
    rc = main(["bench", "latency", "--model", str(model), "--load-format", "dummy",
               "--dtype", "float32", "--batch-size", "2", "--input-len", "5",
               "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0",
               "--kv-cache-memory", str(1 << 22), "--no-roofline", "--profile-kernels", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "kernel profile: batch 2, input 5, the 1 decode steps of 2 output tokens" in out
    table = out.split("kernel profile:", 1)[1]
    assert "Self CPU" in table and "aten::" in table, table
