"""The runner on CUDA (`pytest -m gpu`; skipped without CUDA): greedy equality with the CPU
torch reference and with HF, CUDA graphs on vs off, memory profiling."""

from __future__ import annotations

import pytest
import torch
from utils import assert_tie_rule, hf_greedy, ours_as_pairs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 301, 302, 303, 304, 305, 306, 307, 308, 9],
           [77] * 21]


def _llm(path, **kw):
    from pagedserve import LLM

    # NOTE: a fixed KV budget: engines of earlier tests may still hold their caches.
    base = {"dtype": "float32", "block_size": 16, "max_model_len": 128, "max_num_seqs": 8,
            "kv_cache_memory": 1 << 28}
    base.update(kw)
    return LLM(str(path), **base)


def _greedy(llm, max_tokens=12, logprobs=None):
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                               params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_cuda_greedy_equals_cpu_reference_and_hf(checkpoints, hf_models, arch):
    path = checkpoints(arch)
    cpu = _greedy(_llm(path, device="cpu", kv_cache_memory=1 << 24), logprobs=5)
    gpu = _llm(path, device="cuda")
    assert gpu.engine.executor.runner.attention_backend == "triton"
    got = _greedy(gpu, logprobs=5)
    for i, (a, b) in enumerate(zip(got, cpu)):
        assert_tie_rule(ours_as_pairs(a), ours_as_pairs(b), f"{arch} prompt {i} cuda vs cpu")
    hf = hf_models(arch)
    for i, (p, a) in enumerate(zip(PROMPTS, got)):
        assert_tie_rule(ours_as_pairs(a), hf_greedy(hf, p, 12), f"{arch} prompt {i} vs HF")


def test_cuda_graphs_equal_eager(checkpoints):
    path = checkpoints("llama")
    eager = _greedy(_llm(path, device="cuda", enforce_eager=True), max_tokens=20)
    llm = _llm(path, device="cuda")
    graphs = llm.engine.executor.runner.graphs
    assert graphs is not None and sorted(graphs.entries) == [1, 2, 4, 8]
    got = _greedy(llm, max_tokens=20)
    assert graphs.replays > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    # bf16, the dtype that serves: still equal (the same kernels, only replayed)
    eager16 = _greedy(_llm(path, device="cuda", dtype="bfloat16", enforce_eager=True))
    got16 = _greedy(_llm(path, device="cuda", dtype="bfloat16"))
    assert [o.token_ids for o in got16] == [o.token_ids for o in eager16]


def test_torch_backend_on_cuda_runs_eagerly(checkpoints):
    path = checkpoints("llama")
    llm = _llm(path, device="cuda", attention_backend="torch")
    assert llm.engine.executor.runner.graphs is None
    ref = _greedy(_llm(path, device="cuda", enforce_eager=True))
    assert [o.token_ids for o in _greedy(llm)] == [o.token_ids for o in ref]


def test_memory_profiling_sizes_the_kv_cache(checkpoints):
    import gc

    path = checkpoints("llama")
    gc.collect()
    torch.cuda.empty_cache()  # the caches of earlier tests' engines would count as used
    llm = _llm(path, device="cuda", gpu_memory_utilization=0.5, kv_cache_memory=None)
    engine = llm.engine
    total = torch.cuda.get_device_properties(0).total_memory
    block_bytes = engine.kv_cache.layers[0][0][0].numel() * 4 * 2 * len(engine.kv_cache.layers)
    assert engine.num_kv_blocks > 0
    assert engine.num_kv_blocks * block_bytes < 0.5 * total
    assert engine.num_kv_blocks * block_bytes > 0.3 * total  # a tiny model leaves most of it
    assert len(_greedy(llm)[0].token_ids) == 12
    with pytest.raises(ValueError, match="no GPU memory left"):
        _llm(path, device="cuda", gpu_memory_utilization=1e-6, kv_cache_memory=None)


def test_greedy_fast_path_matches_host_sampler(checkpoints):
    """Plain greedy rows are chosen on the GPU; asking logprobs takes the host sampler."""
    llm = _llm(checkpoints("llama"), device="cuda")
    fast = _greedy(llm)
    slow = _greedy(llm, logprobs=1)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
