"""Weights kept quantized (layers/quantization.py): what `quantization` resolves to, INT8 models
against HF within the tie rule, and a request's results independent of its batch."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.kernels.cpu_qlinear import quantized_available
from pagedserve.layers.quantization import resolve_quantization
from utils import assert_tie_rule, hf_greedy, ours_as_pairs

needs_kernels = pytest.mark.skipif(not quantized_available(), reason="compiled CPU kernels unavailable")


def test_quantization_resolves_per_source_and_device():
    if quantized_available():
        assert resolve_quantization(None, "gguf", "cpu", 1) == "gguf"
        assert resolve_quantization("int8", "hf", "cpu", 1) == "int8"
    assert resolve_quantization(None, "hf", "cpu", 1) == "none"
    assert resolve_quantization(None, "gguf", "cuda", 1) == "none"
    assert resolve_quantization(None, "gguf", "cpu", 2) == "none"
    assert resolve_quantization("none", "gguf", "cpu", 1) == "none"
    with pytest.raises(ValueError, match="GGUF"):
        resolve_quantization("gguf", "hf", "cpu", 1)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int8", "hf", "cuda", 1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_quantization("int8", "hf", "cpu", 2)
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="fp4")


def _quantized_weights(llm: LLM) -> dict[str, str]:
    model = llm.engine.executor.model
    return {name: p.quant.format.name for name, p in model.named_parameters()
            if getattr(p, "quant", None) is not None}


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_int8_greedy_tokens_match_hf_within_the_tie_rule(checkpoints, hf_models, arch):
    llm = LLM(str(checkpoints(arch)), dtype="float32", block_size=4, kv_cache_memory=1 << 22,
              quantization="int8")
    quantized = _quantized_weights(llm)
    assert quantized and set(quantized.values()) == {"int8"}
    assert any("embed_tokens" in n for n in quantized) and any("down_proj" in n for n in quantized)
    prompts = [[1, 5, 9, 200, 31, 7], [1, 400, 3, 3, 3, 90, 12, 17, 250]]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf_models(arch), prompt, 12)
        assert_tie_rule(ours_as_pairs(out.outputs[0]), ref, f"{arch} {prompt}")


def _assert_alone_equals_batched(llm, target, others, params, sizes) -> None:
    """`target`'s tokens and logprobs alone equal them in a batch with the first n of `others`,
    for each n in `sizes` (exactly: same bits)."""

    def run(batch):
        out = llm.generate([target, *batch], params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]

    alone = run([])
    for n in sizes:
        assert run(others[:n]) == alone, f"batch of {n + 1}"


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_bf16_request_is_bit_identical_alone_and_in_batches_of_2_to_64(checkpoints, quantization):
    llm = LLM(str(checkpoints("gemma3")), dtype="bfloat16", block_size=4, kv_cache_memory=16 << 20,
              quantization=quantization)
    gen = torch.Generator().manual_seed(0)
    target = {"prompt_token_ids": torch.randint(3, 500, (11,), generator=gen).tolist()}
    others = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=gen).tolist()}
              for n in torch.randint(2, 20, (63,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)

    _assert_alone_equals_batched(llm, target, others, params, (1, 3, 15, 63))


@pytest.fixture(scope="module")
def embedded_bf16_llm():
    """The embedded Gemma 3 270M Q4_K_M, bf16 activations, its blocks kept (the default), in the
    batch-invariant mode."""
    return LLM("gemma-3-270m", dtype="bfloat16", kv_cache_memory=64 << 20, batch_invariant=True)


@pytest.mark.slow
@needs_kernels
def test_embedded_model_runs_quantized_by_default(embedded_bf16_llm):
    llm = embedded_bf16_llm
    formats = set(_quantized_weights(llm).values())
    assert {"q8_0", "q5_0", "q4_k", "q6_k"} <= formats  # as the Q4_K_M file stores them
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text or len(out.token_ids) == 8


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_request_is_bit_identical_alone_and_in_batches(request, dtype):
    """The ggml blocks' 8-bit-activation products (every format of the Q4_K_M file) keep a
    request's tokens and logprobs independent of the batch it runs in."""
    llm = request.getfixturevalue("embedded_llm" if dtype == "float32" else "embedded_bf16_llm")
    gen = torch.Generator().manual_seed(1)
    target = {"prompt_token_ids": [2, *torch.randint(100, 20000, (13,), generator=gen).tolist()]}
    others = [{"prompt_token_ids": [2, *torch.randint(100, 20000, (int(n),), generator=gen).tolist()]}
              for n in torch.randint(2, 24, (31,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)

    _assert_alone_equals_batched(llm, target, others, params, (1, 6, 31))


@pytest.mark.slow
@needs_kernels
def test_embedded_model_default_kernels_agree_with_the_batch_invariant_mode(embedded_bf16_llm):
    """The default (fastest kernel per row count: the blocked GEMM from 8 rows on AVX512-BF16)
    against the batch-invariant mode on a batch of 12 requests: the same greedy tokens within
    vLLM's tie rule, and the GEMM really ran (the logprobs are not bit-identical)."""
    from pagedserve.kernels.cpu_qlinear import GEMM_ROWS
    from pagedserve.kernels.cpu_gemm import linear_isa

    default = LLM("gemma-3-270m", dtype="bfloat16", kv_cache_memory=64 << 20)
    assert not any(getattr(p, "quant", None) is not None and p.quant.batch_invariant
                   for p in default.engine.executor.model.parameters())
    gen = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": [2, *torch.randint(100, 20000, (int(n),), generator=gen).tolist()]}
               for n in torch.randint(4, 40, (12,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    fast = default.generate(prompts, params, use_tqdm=False)
    exact = embedded_bf16_llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(fast, exact)):
        assert_tie_rule(ours_as_pairs(a.outputs[0]), ours_as_pairs(b.outputs[0]), f"request {i}")
    if GEMM_ROWS.get(linear_isa(), 0):
        assert [ours_as_pairs(o.outputs[0]) for o in fast] != [ours_as_pairs(o.outputs[0]) for o in exact]
