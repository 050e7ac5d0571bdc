"""LoRA on top of every base weight format: bf16 weights, INT8 per-channel weights and GGUF
blocks (the embedded model) -- the base product untouched, the adapter's added next to it. Decode
steps run the fused CPU decode layer, with or without adapters (bit for bit the unfused layers:
tests/lora/test_lora_fused_decode.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import pagedserve.platforms.cpu_decode as llama  # where the fused decode call lives
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.lora.adapter import owner, target_dims
from utils import assert_tie_rule, ours_as_pairs, output_key

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
def test_bf16_and_int8_bases_take_the_adapter(
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
    assert mixed[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids != base[0].outputs[0].token_ids
    # the adapter's continuation is the float32 one (a near-tie at most)
    exact = LLM(str(lora_base), dtype="float32", enable_lora=True, block_size=4)
    ref = exact.generate(PROMPTS[:1], PARAMS, lora_request=r8, use_tqdm=False)[0]
    assert_tie_rule(ours_as_pairs(mixed[0].outputs[0]), ours_as_pairs(ref.outputs[0]))


@pytest.fixture(scope="module")
def gemma(checkpoints, tmp_path_factory):
    """The tiny Gemma 3 (head_dim 32: the fused decode layer runs on it, not on the tiny Llama)
    and three adapters over it: "r8" (every projection), "r16" (q, v, down), "r4" (o, gate, up)."""
    import tiny

    base = checkpoints("gemma3")
    root = tmp_path_factory.mktemp("gemma_adapters")
    paths = {"r8": tiny.make_lora_adapter(root / "r8", base, 8, seed=1),
             "r16": tiny.make_lora_adapter(root / "r16", base, 16, seed=2,
                                           targets=("q_proj", "v_proj", "down_proj")),
             "r4": tiny.make_lora_adapter(root / "r4", base, 4, seed=3,
                                          targets=("o_proj", "gate_proj", "up_proj"))}
    return base, {name: LoRARequest(name, i + 1, str(path))
                  for i, (name, path) in enumerate(paths.items())}


def test_bf16_request_with_its_adapter_is_exact_on_fused_and_mixed_steps(gemma, monkeypatch):
    """bf16 on the fused decode layer with adapters: a request's tokens and logprobs with its
    adapter are the same alone, in a batch of other adapters' and the base model's decode steps
    (fused), and in steps mixed with chunked prompts (the unfused layers with their hooks)."""
    from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa
    from pagedserve.kernels.cpu_isa import ISA_LEVELS

    if not kernel_available():
        pytest.skip("CPU kernels unavailable here")
    ran = []  # per fused call: whether it ran, with adapters
    real = llama.decoder_layer

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        ran.append((out is not None, kwargs.get("lora") is not None))
        return out

    monkeypatch.setattr(llama, "decoder_layer", recording)
    base, loras = gemma
    opts = dict(dtype="bfloat16", block_size=4, enable_lora=True, max_loras=3, max_lora_rank=16)
    llm = LLM(str(base), **opts)
    target = [{"prompt_token_ids": [1, 33, 71, 5, 290, 8, 14, 61, 2, 77, 19]}]
    others = [{"prompt_token_ids": [1, 5, 9]}, {"prompt_token_ids": list(range(3, 20))},
              {"prompt_token_ids": [1, 400, 7, 3, 8, 3]}]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
    r8, r16, r4 = (loras[n] for n in ("r8", "r16", "r4"))
    alone = llm.generate(target, params, lora_request=r8, use_tqdm=False)[0]
    assert ran and all(r == (True, True) for r in ran), "every decode step ran fused, adapted"
    ran.clear()
    mixed = llm.generate(others[:1] + target + others[1:], params,
                         lora_request=[r16, r8, None, r4], use_tqdm=False)[1]
    assert ran and all(r == (True, True) for r in ran)
    assert output_key(mixed) == output_key(alone)
    plain = llm.generate(target, params, use_tqdm=False)[0]
    assert output_key(plain) != output_key(alone), "the adapter changes the request"
    small = LLM(str(base), max_num_batched_tokens=8, **opts)  # prompts chunked into decodes
    again = small.generate(others + target, params, lora_request=[r16, r4, r16, r8],
                           use_tqdm=False)[3]
    if linear_isa() >= ISA_LEVELS["avx512bf16"]:
        assert output_key(again) == output_key(alone)
    else:
        # NOTE: below AVX512-BF16 a bf16 prompt chunk's attention is torch's SDPA
        # (kernels/cpu_attention.py), whose bits depend on how the prompt was chunked (a 1e-3
        # logprob shift on CI's AVX2-only CPU; also with PAGEDSERVE_CPU_ISA=avx2
        # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 one): exactness is stated in float32.
        assert_tie_rule(ours_as_pairs(again.outputs[0]), ours_as_pairs(alone.outputs[0]))


def random_adapter(path, config, rank, seed):
    """A PEFT-format adapter of random weights on every projection of `config`'s layers."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    dims = target_dims(config)
    for (layer, module), (d_in, d_out) in dims.items():
        prefix = f"base_model.model.model.layers.{layer}.{owner(module)}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * d_in ** -0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": sorted({module for _, module in dims})}))
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
