"""LoRA on top of every base weight format: bf16 weights, INT8 per-channel weights and GGUF
blocks (the embedded model) -- the base product untouched, the adapter's added next to it. A
base-only step keeps the fused CPU decode layer; a step with an adapter runs the unfused layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import pagedserve.platforms.cpu_decode as llama  # where the fused decode call lives
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.lora.adapter import target_dims
from utils import assert_tie_rule, ours_as_pairs

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 17, 42, 99, 7, 250]}, {"prompt_token_ids": [1, 5, 9, 300]}]


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    real = llama.decoder_layer

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "decoder_layer", counting)
    return calls


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bf16_and_int8_bases_take_the_adapter_and_keep_the_fused_path_for_base_steps(
        lora_base, lora_requests, quantization, fused_calls):
    from pagedserve.kernels.cpu_gemm import kernel_available

    opts = dict(dtype="bfloat16", quantization=quantization, block_size=4)
    llm = LLM(str(lora_base), enable_lora=True, max_loras=2, **opts)
    plain = LLM(str(lora_base), **opts)
    fused_calls.clear()
    base = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    if kernel_available():
        assert fused_calls, "a base-only decode step runs the fused layer"
    assert [o.outputs[0].token_ids for o in base] == \
        [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS, use_tqdm=False)]
    fused_calls.clear()
    r8 = lora_requests["r8"]
    mixed = llm.generate(PROMPTS, PARAMS, lora_request=[r8, None], use_tqdm=False)
    assert not fused_calls, "a step with an adapter runs the unfused layer"
    assert mixed[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids != base[0].outputs[0].token_ids
    # the adapter's continuation is the float32 one (a near-tie at most)
    exact = LLM(str(lora_base), dtype="float32", enable_lora=True, block_size=4)
    ref = exact.generate(PROMPTS[:1], PARAMS, lora_request=r8, use_tqdm=False)[0]
    assert_tie_rule(ours_as_pairs(mixed[0].outputs[0]), ours_as_pairs(ref.outputs[0]))


def random_adapter(path, config, rank, seed):
    """A PEFT-format adapter of random weights on every projection of `config`'s layers."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (d_in, d_out) in target_dims(config).items():
            owner = "self_attn" if module[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * d_in ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(target_dims(config))}))
    return path


@pytest.mark.slow
def test_gguf_blocks_take_the_adapter(embedded_gguf_path, tmp_path):
    llm = LLM(str(embedded_gguf_path), enable_lora=True, max_loras=1)
    assert getattr(llm.engine.model.model.layers[0].self_attn.q_proj.weight, "quant", None) \
        is not None, "the GGUF blocks are kept"
    adapter = LoRARequest("g", 1, str(random_adapter(tmp_path / "g", llm.engine.model_config,
                                                     8, seed=0)))
    ps = ["The capital of France is", "One, two, three,"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate(ps, params, use_tqdm=False)
    mixed = llm.generate(ps, params, lora_request=[adapter, None], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids != base[0].outputs[0].token_ids
