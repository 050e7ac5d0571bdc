"""The fused decode layer (kernels.cpu_decoder_layer, chosen in platforms.cpu_decode)
gives exactly the modules' logits on bf16 CPU decode steps, for every model that may use it."""

from __future__ import annotations

import pytest
import torch
import transformers
from utils import PagedRunner

from pagedserve.kernels import cpu_decoder_layer, cpu_gemm
from pagedserve.models import llama
from pagedserve.models.loader import load_model
from pagedserve.platforms import cpu_decode
from pagedserve.kernels.extension import kernels_disabled

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              max_position_embeddings=256)


def configs():
    yield "llama", transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    yield "qwen2 (qkv bias)", transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=1)
    yield "qwen3 (q/k norm)", transformers.Qwen3Config(
        **COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    yield "gemma3 (sandwich norms, window)", transformers.Gemma3TextConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])
    # dense families of issue 35 whose layers are Llama's: Phi-3 (fused checkpoint tensors split
    # at load, LongRoPE over the whole head), SmolLM3 (its NoPE layer: identity cos / sin)
    yield "phi3 (longrope)", transformers.Phi3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + i / 8 for i in range(16)],
                         "long_factor": [1.0 + i for i in range(16)]})
    yield "smollm3 (nope layer)", transformers.SmolLM3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2)


def unfused_configs():
    """Families whose layers the fused kernel cannot run: they must run their modules."""
    yield "gemma2 (soft-capped scores)", transformers.Gemma2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=5)
    yield "phi4-mini (partial rotary)", transformers.Phi3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    yield "granite (residual multiplier)", transformers.GraniteConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, residual_multiplier=0.5)
    yield "glm4 (interleaved rope)", transformers.Glm4Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=1.0)
    # parallel blocks with LayerNorms (not FusableDecoderLayers: the modules, decode included)
    yield "cohere (parallel block, layernorm)", transformers.CohereConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True)
    yield "cohere2 (parallel block, nope full layer)", transformers.Cohere2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")


def _count_fused_calls(monkeypatch, kernel: str = "decoder_layer") -> list[bool]:
    """Record, per call of the fused layer (`kernel` "decoder_layer_attn": its attention half),
    whether it ran (not None)."""
    calls = []
    real = getattr(cpu_decoder_layer, kernel)

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decode, kernel, counting)
    return calls


def _run(model, prompts, steps, kv_dtype=None):
    """Prefill every prompt, then `steps` decode-only steps of all of them (greedy); caches in
    the model's dtype, or `kv_dtype` (fp8 blocks)."""
    runner = PagedRunner(model, seed=3, kv_dtype=kv_dtype)
    last = [out[-1] for out in runner.step(list(enumerate(prompts)))]
    logits = []
    for _ in range(steps):
        batch = [(i, [int(lg.argmax())]) for i, lg in enumerate(last)]
        last = [out[-1] for out in runner.step(batch)]
        logits.append(torch.stack(last))
    return logits


@pytest.mark.parametrize("name,config", list(configs()), ids=[n for n, _ in configs()])
def test_fused_decode_layer_equals_the_modules_bit_for_bit(kernel, name, config, monkeypatch):
    torch.manual_seed(0)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (7, 3, 11)]
    calls = _count_fused_calls(monkeypatch)
    fused = _run(model, prompts, steps=8)
    assert calls and all(calls), "the fused layer did not run on decode steps"
    assert len(calls) == 8 * config.num_hidden_layers  # decode steps only, never prefill
    monkeypatch.setattr(cpu_decode, "fused_decode_layer", lambda *a: None)  # every family's layers call it
    modules = _run(model, prompts, steps=8)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"{name}: decode step {step} differs"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_decode_layer_over_fp8_blocks_equals_the_modules_bit_for_bit(kernel, kv_dtype,
                                                                           monkeypatch):
    """kv_cache_dtype fp8: the fused call writes the step's K/V rounded and saturated as the
    modules' write does (attention.kv_dtype.to_cache) and attends over the fp8 blocks with the
    same decode kernel: the logits equal the modules' (Gemma 3: sandwich norms, q/k norms, a
    sliding window)."""
    name, config = next((n, c) for n, c in configs() if n.startswith("gemma3"))
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    calls = _count_fused_calls(monkeypatch)
    fused = _run(model, prompts, steps=6, kv_dtype=kv_dtype)
    assert calls and all(calls), "the fused layer did not run on decode steps over fp8 blocks"
    monkeypatch.setattr(cpu_decode, "fused_decode_layer", lambda *a: None)
    modules = _run(model, prompts, steps=6, kv_dtype=kv_dtype)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"{name}, {kv_dtype}: decode step {step} differs"
    assert not torch.equal(fused[-1], _run(model, prompts, steps=6)[-1])  # fp8 KV is not bf16's


@pytest.mark.parametrize("name,config", list(unfused_configs()), ids=[n for n, _ in unfused_configs()])
def test_layers_the_kernel_cannot_run_are_left_to_their_modules(kernel, name, config, monkeypatch):
    torch.manual_seed(0)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    calls = _count_fused_calls(monkeypatch)
    _run(model, [torch.randint(0, VOCAB, (n,)).tolist() for n in (7, 3)], steps=2)
    assert not calls, f"{name}: the fused layer was called"


def test_fused_decode_layer_is_skipped_in_float32_and_mixed_steps(kernel, monkeypatch):
    _, config = next(configs())
    calls = []
    monkeypatch.setattr(cpu_decode, "decoder_layer", lambda *a: calls.append(1))
    model = load_model(config, weights=None, dtype=torch.float32, seed=0)
    _run(model, [[1, 2, 3]], steps=2)  # fp32: never
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    runner = PagedRunner(model)
    runner.step([(0, [1, 2, 3])])
    runner.step([(0, [4]), (1, [5, 6])])  # a decode row next to a prompt: not decode-only
    assert calls == []


def test_fused_decode_layer_follows_norm_weights_changed_in_place(kernel, monkeypatch):
    """The fused call keeps the norms' fp32 weights between steps: a weight changed in place
    (as loading new weights does) must reach it, bit-identical to the modules again."""
    name, config = next((n, c) for n, c in configs() if n.startswith("gemma3"))  # sandwich + q/k norms
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    prompts = [[1, 2, 3], [4, 5]]
    before = _run(model, prompts, steps=2)  # builds each layer's plan and its norm weights
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, llama.FusableDecoderLayer):
                layer.pre_feedforward_layernorm.weight.add_(0.5)
                layer.self_attn.k_norm.weight.mul_(-1.0)
    fused = _run(model, prompts, steps=2)
    assert not all(torch.equal(a, b) for a, b in zip(before, fused))
    monkeypatch.setattr(cpu_decode, "fused_decode_layer", lambda *a: None)
    modules = _run(model, prompts, steps=2)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"{name}: decode step {step} differs after the norm change"


def _quantize_projections(model, mlp: bool) -> None:
    """Each layer's q / k / v / o (and gate / up / down: `mlp`) as GGUF blocks, Q8_0 and Q5_0
    alternating."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from pagedserve.kernels.cpu_qlinear import FORMATS
    from pagedserve.layers.quantization import QuantizedTensor, install_quantized_tensor

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if mlp:
            mods += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        for j, mod in enumerate(mods):
            fmt, qtype = (("q8_0", T.Q8_0), ("q5_0", T.Q5_0))[(i + j) % 2]
            w = mod.weight.float().numpy()
            blocks = torch.from_numpy(np.ascontiguousarray(quantize(w, qtype)))
            install_quantized_tensor(model, mod.weight, QuantizedTensor(blocks, FORMATS[fmt], w.shape, int(qtype)))


@pytest.mark.parametrize("batch", [3, 9])  # 9 >= GEMM_ROWS on AVX512-BF16: the blocked GEMM too
def test_fused_decode_layer_over_gguf_blocks_equals_the_modules_bit_for_bit(kernel, batch, monkeypatch):
    """The fused layer's q / k / v and gate / up products run as one call each (qlinear_fused):
    with Q8_0 / Q5_0 weights as a GGUF file stores them, the logits still equal the modules'."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    _quantize_projections(model, mlp=True)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in range(3, 3 + batch)]
    _assert_fused_equals_modules(model, prompts, 4, monkeypatch)


def _assert_fused_equals_modules(model, prompts, steps: int, monkeypatch, what: str = "") -> None:
    """Decode steps with the fused layer (which must run on every one) give exactly the logits of
    the same steps through the modules."""
    calls = _count_fused_calls(monkeypatch)
    fused = _run(model, prompts, steps=steps)
    assert calls and all(calls), "the fused layer did not run on decode steps"
    monkeypatch.setattr(cpu_decode, "fused_decode_layer", lambda *a: None)
    modules = _run(model, prompts, steps=steps)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"decode step {step} differs {what}"


def _mixed_format_projections(model) -> list[str]:
    """Each layer's seven projections in four ggml formats whose row thresholds differ on
    AVX512-BF16 (`cpu_qlinear.GEMM_ROWS_BY_FORMAT`): returns the formats used."""
    from gguf import GGMLQuantizationType
    from utils import ggml_block_bytes

    from pagedserve.kernels.cpu_qlinear import FORMATS
    from pagedserve.layers.quantization import QuantizedTensor, install_quantized_tensor

    cycle = ["q8_0", "q5_0", "q4_k", "q6_k", "q4_k", "q5_0", "q6_k"]  # q k v o gate up down
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        for j, (mod, fmt) in enumerate(zip(mods, cycle)):
            n, k = mod.weight.shape
            blocks = torch.from_numpy(ggml_block_bytes(fmt, n, k, seed=10 * i + j).copy())
            install_quantized_tensor(model, mod.weight, QuantizedTensor(
                blocks, FORMATS[fmt], (n, k), int(GGMLQuantizationType[fmt.upper()])))
    return cycle


@pytest.mark.parametrize("batch", [6, 8])
def test_fused_decode_layer_takes_each_projections_own_row_threshold(kernel, batch, monkeypatch):
    """Projections of different formats switch from the small-batch kernel to the GEMM at
    different row counts (on AVX512-BF16 Q8_0 / Q5_0 from 6, Q4_K / Q6_K from 9): at 6 and 8
    sequences the fused layer runs some products on one kernel and some on the other,
    each as its module does, so the logits equal the modules' exactly."""
    from pagedserve.kernels.cpu_qlinear import gemm_rows

    torch.manual_seed(0)
    # (wide enough that the two kernels' fp32 roundings show through the bf16 results: K up to
    # 2048, ~40k outputs a layer and step)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048,
                                      num_hidden_layers=2, max_position_embeddings=256,
                                      num_attention_heads=8, num_key_value_heads=4)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    _mixed_format_projections(model)
    attn = model.model.layers[0].self_attn
    isa = cpu_gemm.linear_isa()
    thresholds = {gemm_rows(m.weight.quant, torch.bfloat16, isa) for m in (attn.q_proj, attn.v_proj, attn.o_proj)}
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in range(3, 3 + batch)]
    _assert_fused_equals_modules(model, prompts, 3, monkeypatch, f"(row thresholds {sorted(thresholds)})")


def moe_configs():
    """MoE families whose layers have Llama's attention: the attention half runs fused, the MoE
    block (its experts in one call: bf16 weights, format 0) from Python."""
    moe = dict(num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    yield "mixtral (window)", transformers.MixtralConfig(
        **COMMON, **moe, num_local_experts=4, sliding_window=5)
    yield "qwen3_moe (q/k norm, a dense layer)", transformers.Qwen3MoeConfig(
        **COMMON, **moe, head_dim=64, num_experts=4, moe_intermediate_size=64, norm_topk_prob=True,
        decoder_sparse_step=2)
    yield "qwen2_moe (qkv bias, shared expert)", transformers.Qwen2MoeConfig(
        **COMMON, **moe, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=96)
    yield "olmoe (whole-projection q/k norms, clip_qkv)", transformers.OlmoeConfig(
        **COMMON, **moe, num_experts=4, clip_qkv=0.3)
    yield "gpt_oss (sinks, fp32-weight norms, biases, windows)", transformers.GptOssConfig(
        **COMMON, **moe, head_dim=32, num_local_experts=4, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "gguf-attention"])
@pytest.mark.parametrize("name,config", list(moe_configs()), ids=[n for n, _ in moe_configs()])
def test_moe_layers_attention_half_fused_equals_the_modules_bit_for_bit(kernel, name, config, quantized,
                                                                       monkeypatch):
    """Decode steps of MoE models: the attention half in one call, then the MoE block; logits
    (so tokens and logprobs) equal the modules' exactly, with bf16 attention projections or
    GGUF blocks (Q8_0 / Q5_0) of them, over 3 and (quantized) 9 sequences."""
    torch.manual_seed(0)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    if quantized:
        _quantize_projections(model, mlp=False)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in ((7, 3, 11) + ((5, 2, 8, 4, 6, 9) if quantized else ()))]
    calls = _count_fused_calls(monkeypatch, "decoder_layer_attn")
    fused = _run(model, prompts, steps=2)
    assert calls and all(calls) and len(calls) == 2 * config.num_hidden_layers, calls
    monkeypatch.setattr(cpu_decode, "fused_decode_attention", lambda *a: None)
    modules = _run(model, prompts, steps=2)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"{name}: decode step {step} differs"


def test_moe_layers_whose_attention_does_not_declare_the_fused_half_run_their_modules(kernel, monkeypatch):
    """An attention module other than Llama's runs fused only when it declares that the fused
    half computes its forward (`fused_attention_half`): without the flag, OLMoE's layers run
    their modules."""
    from pagedserve.models.olmoe import OlmoeAttention

    monkeypatch.setattr(OlmoeAttention, "fused_attention_half", False)
    config = transformers.OlmoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    calls = []
    monkeypatch.setattr(cpu_decode, "decoder_layer_attn", lambda *a, **k: calls.append(1))
    _run(model, [[1, 2, 3], [4, 5]], steps=2)
    assert not calls


@pytest.mark.parametrize("floor_scale", [64, 4], ids=["temperature-1", "temperature"])
def test_llama4_nope_layers_attention_half_fused_equals_the_modules_bit_for_bit(kernel, floor_scale,
                                                                               monkeypatch):
    """Llama 4: a NoPE layer's attention (no RoPE -- the identity tables --, no q/k norm) runs
    as the fused half on decode steps whose query temperature is exactly 1 (every position
    below floor_scale - 1); past it, and on the RoPE layers (pairs in float32, L2 norm after
    RoPE) always, the modules. Logits equal the modules' either way."""
    config = transformers.Llama4TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size_mlp=256, num_local_experts=4, num_experts_per_tok=1, moe_layers=[1, 2],
        no_rope_layers=[1, 0, 1, 0], floor_scale=floor_scale, attn_scale=0.5)
    torch.manual_seed(0)
    model = load_model(config, weights=None, dtype=torch.bfloat16, seed=0)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (7, 3, 11)]
    calls = _count_fused_calls(monkeypatch, "decoder_layer_attn")
    fused = _run(model, prompts, steps=2)
    # the two NoPE layers of each decode step, and only while the temperature is 1
    assert calls == ([True] * 4 if floor_scale == 64 else []), calls
    monkeypatch.setattr(cpu_decode, "fused_decode_attention", lambda *a: None)
    modules = _run(model, prompts, steps=2)
    for step, (a, b) in enumerate(zip(fused, modules)):
        assert torch.equal(a, b), f"llama4: decode step {step} differs"
