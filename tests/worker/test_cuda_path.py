"""CPU tests of the CUDA path's pure pieces: graph buckets and padding, the KV budget from a
memory profile, the profiling batch, the config options, and the graph buffer logic end to end
(an eager stand-in for graph capture, the Triton backend under its interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineArgs
from pagedserve.worker.cuda_graphs import (
    graph_batch_sizes,
    pad_decode_batch,
    pick_bucket,
)
from pagedserve.worker.kv_cache import kv_budget_from_profile, max_concurrency
from pagedserve.worker.model_runner import profile_seq_lens


def test_graph_batch_sizes_are_bucketed_up_to_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert sizes == sorted(set(sizes))
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_pick_bucket_is_the_smallest_size_that_fits():
    sizes = graph_batch_sizes(40)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 33, 40)] == \
        [1, 2, 4, 8, 8, 16, 24, 40, 40]
    assert pick_bucket(41, sizes) is None
    with pytest.raises(ValueError):
        pick_bucket(0, sizes)


def test_pad_decode_batch_pads_rows_and_block_tables_with_the_null_block():
    p = pad_decode_batch([7, 8, 9], [5, 0, 17], [[3, 4], [5], [6, 2]], [6, 1, 18],
                         bucket=4, max_blocks=3, null_block=99)
    assert p.input_ids == [7, 8, 9, 0]
    assert p.positions == [5, 0, 17, 0]
    assert p.block_tables == [[3, 4, 99], [5, 99, 99], [6, 2, 99], [99, 99, 99]]
    assert p.seq_lens == [6, 1, 18, 1]
    assert p.query_lens == [1, 1, 1, 1] and p.num_real == 3
    with pytest.raises(ValueError):
        pad_decode_batch([1] * 5, [0] * 5, [[0]] * 5, [1] * 5, bucket=4, max_blocks=1,
                         null_block=9)
    with pytest.raises(ValueError):
        pad_decode_batch([1], [0], [[0, 1]], [1], bucket=1, max_blocks=1, null_block=9)


def test_kv_budget_from_profile():
    gib = 2**30
    assert kv_budget_from_profile(100 * gib, 0.9, 30 * gib, 1 << 20) == 60 * gib
    assert kv_budget_from_profile(100 * gib, 1.0, 0, 1) == 100 * gib
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        kv_budget_from_profile(100 * gib, 0.5, 50 * gib, 1 << 20)
    with pytest.raises(ValueError, match="no GPU memory left"):
        kv_budget_from_profile(100 * gib, 0.5, 50 * gib - (1 << 20), 1 << 20)  # one block only
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_profile(100 * gib, 0.0, 0, 1)
    assert max_concurrency(1000, 16, 2048) == pytest.approx(7.8125)


def test_profile_batch_fills_the_token_budget_within_the_limits():
    for tokens, seqs, mml in [(2048, 256, 2048), (2048, 4, 128), (100, 256, 8), (5, 3, 100),
                              (8192, 1, 4096)]:
        lens = profile_seq_lens(tokens, seqs, mml)
        assert sum(lens) == min(tokens, seqs * mml)
        assert len(lens) <= seqs and max(lens) <= mml and min(lens) >= 1
        assert max(lens) - min(lens) <= 1


def test_engine_args_cuda_options_are_validated():
    args = EngineArgs()
    assert (args.gpu_memory_utilization, args.enforce_eager, args.attention_backend) == \
        (0.9, False, "auto")
    for bad in (0, 0.0, -0.1, 1.5, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineArgs(gpu_memory_utilization=bad)
    EngineArgs(gpu_memory_utilization=1.0)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flash")


def test_skip_tokenizer_init_runs_token_ids(checkpoints):
    from pagedserve import LLM, SamplingParams

    path = checkpoints("llama")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)
    bare = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, skip_tokenizer_init=True)
    assert bare.engine.tokenizer is None
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 250]}
    a = ref.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    b = bare.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and b.text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        bare.generate(["hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="stop"):
        bare.generate([prompt], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)


GRAPH_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from pagedserve import LLM, SamplingParams

    class EagerGraph:  # stands in for torch.cuda.CUDAGraph: replay reruns the forward
        def __init__(self, fn, out):
            self.fn, self.out = fn, out
        def replay(self):
            self.out.copy_(self.fn())

    def capture(fn, pool):
        out = fn()
        return EagerGraph(fn, out), out, pool

    path = sys.argv[1]
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3 * i + 1, 250][: 2 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_memory=1 << 22, attention_backend="triton",
              max_num_seqs=3, block_size=4, max_model_len=32, enable_prefix_caching=False)
    eager = LLM(path, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **kw)
    runner = llm.engine.executor.runner
    runner.capture_graphs(3, 32, capture=capture)
    assert sorted(runner.graphs.entries) == [1, 2, 3]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.graphs.replays > 0, "no decode step replayed a graph"
    assert got == want, (got, want)
    ref = LLM(path, dtype="float32", kv_cache_memory=1 << 22, attention_backend="torch")
    torch_out = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == torch_out, (got, torch_out)
    print("OK", runner.graphs.replays)
""")


def test_decode_graph_buffers_match_eager_steps(checkpoints, tmp_path):
    """The padded, persistent-buffer decode path (with an eager stand-in for capture and the
    Triton backend under its interpreter) gives the eager steps' tokens."""
    pytest.importorskip("triton")
    script = tmp_path / "graphs.py"
    script.write_text(GRAPH_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script), str(checkpoints("llama"))], env=env,
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout
