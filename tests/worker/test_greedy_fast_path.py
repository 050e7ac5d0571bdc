"""Plain-greedy CPU steps choose tokens with the LM head's fused argmax (`greedy_tokens`, no fp32
logits): the same tokens as the logits + host sampler path, and only when nothing else is asked."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.extension import kernels_disabled


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 200, (int(length),), generator=g).tolist()}
            for length in torch.randint(2, 30, (n,), generator=g)]


def _spy(llm, monkeypatch, disable=False):
    """Count `greedy_tokens` calls that chose the tokens; with `disable`, make it decline."""
    model = llm.engine.executor.runner.model
    real = model.greedy_tokens
    used = []

    def spy(hidden):
        out = None if disable else real(hidden)
        used.append(out is not None)
        return out

    monkeypatch.setattr(model, "greedy_tokens", spy)
    return used


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2", "cohere"])  # cohere: a power-of-two logit scale
def test_fused_greedy_tokens_equal_the_sampler_on_the_logits(kernel, arch, checkpoints, monkeypatch):
    llm = LLM(str(checkpoints(arch)), dtype="bfloat16", block_size=4, kv_cache_memory=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts()
    used = _spy(llm, monkeypatch)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert used and all(used), "the fused argmax did not choose the tokens"
    declined = _spy(llm, monkeypatch, disable=True)
    logits = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert declined and not any(declined)
    assert fused == logits
    assert llm.engine.num_used_blocks() == 0


def test_steps_with_logprobs_penalties_or_sampling_use_the_logits(kernel, checkpoints, monkeypatch):
    llm = LLM(str(checkpoints("llama")), dtype="bfloat16", block_size=4, kv_cache_memory=1 << 22)
    used = _spy(llm, monkeypatch)
    prompts = _prompts(n=2)
    for other in (SamplingParams(temperature=0.0, max_tokens=4, logprobs=1),
                  SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3),
                  SamplingParams(temperature=0.8, max_tokens=4, seed=1)):
        # one plain-greedy request next to one asking for more: no step may skip the logits
        plain = SamplingParams(temperature=0.0, max_tokens=4)
        outs = llm.generate(prompts, [plain, other], use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        assert not used, f"fused argmax used next to {other}"
    # Prompt logprobs need the prefill's logits; the decode steps after it are plain greedy.
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1),
                        use_tqdm=False)
    assert all(len(o.prompt_logprobs) == len(p["prompt_token_ids"]) for o, p in zip(outs, prompts))
    assert used == [True] * 3
    assert llm.engine.num_used_blocks() == 0


def test_float32_models_decline_and_sample_from_logits(checkpoints, monkeypatch):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    used = _spy(llm, monkeypatch)
    llm.generate(_prompts(n=2), SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert used and not any(used)
