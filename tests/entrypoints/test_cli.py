"""The `pagedserve` CLI on a tiny model: generate and bench throughput."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiny  # noqa: E402
from pagedserve.entrypoints.cli import main  # noqa: E402


def test_generate_prints_the_greedy_continuation(tmp_path, capsys):
    path = tiny.make_checkpoint(tmp_path / "m", "llama")
    assert main(["generate", "Return the", "--model", str(path), "--max-tokens", "5",
                 "--dtype", "float32", "--kv-cache-memory", str(1 << 22)]) == 0
    text = capsys.readouterr().out
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)
    expected = llm.generate("Return the", SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0].text
    assert text == expected + "\n"


def test_generate_reports_bad_options_as_an_error_naming_them(tmp_path, capsys):
    path = tiny.make_checkpoint(tmp_path / "m", "llama")
    assert main(["generate", "x", "--model", str(path), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_bench_throughput_runs_both_engines_on_the_same_trace(tmp_path, capsys):
    path = tiny.make_checkpoint(tmp_path / "m", "gpt2")
    assert main(["bench", "throughput", "--model", str(path), "--num-prompts", "6",
                 "--input-len-mean", "20", "--output-len-mean", "8", "--dtype", "float32",
                 "--max-num-seqs", "4", "--kv-cache-memory", str(1 << 22),
                 "--baseline", "hf"]) == 0
    out = capsys.readouterr().out
    assert "pagedserve:" in out and "hf-static:" in out and "ratio" in out
    ours = [l for l in out.splitlines() if "pagedserve:" in l][0]
    hf = [l for l in out.splitlines() if "hf-static:" in l][0]
    assert ours.split("(")[1] == hf.split("(")[1]  # same number of output tokens


def test_bench_throughput_samples_when_given_a_temperature(tmp_path, capsys):
    path = tiny.make_checkpoint(tmp_path / "m", "llama")
    args = ["bench", "throughput", "--model", str(path), "--num-prompts", "4",
            "--input-len-mean", "12", "--output-len-fixed", "6", "--dtype", "float32",
            "--max-num-seqs", "4", "--kv-cache-memory", str(1 << 22),
            "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20", "--baseline", "hf"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sampling: temperature=0.9 top_p=0.9 top_k=20" in out
    assert "pagedserve:" in out and "(24 tokens)" in out and "hf-static:" in out
    assert main(args[:-6] + ["--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_bench_preemption_prints_both_parts_and_writes_a_chart(tmp_path, capsys):
    path = tiny.make_checkpoint(tmp_path / "m", "llama")
    png = tmp_path / "pre.png"
    assert main(["bench", "preemption", "--model", str(path), "--num-prompts", "6",
                 "--input-len-mean", "20", "--output-len-fixed", "12", "--dtype", "float32",
                 "--swap-seqs", "3", "--block-sizes", "1", "16", "--kv-blocks", "4",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "(a)" in out and "(b)" in out
    for mode in ("recompute", "swap", "auto"):
        assert f"{mode}: normalized latency" in out
    assert png.stat().st_size > 1000
