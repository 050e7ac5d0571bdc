"""`pagedserve bench throughput --lora N` runs the trace with N random adapters and without, and
reports both and their ratio."""

from pagedserve.entrypoints.cli import main


def test_bench_throughput_lora_reports_both_runs_and_the_ratio(checkpoints, capsys):
    code = main(["bench", "throughput", "--model", str(checkpoints("llama")), "--lora", "2",
                 "--num-prompts", "4", "--output-len-fixed", "3", "--input-len-mean", "8",
                 "--dtype", "float32", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("2 LoRAs:") == 2 and out.count("base:") == 2
    assert "ratio" in out and "'disk_loads': 2" in out
