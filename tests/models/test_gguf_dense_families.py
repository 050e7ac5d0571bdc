"""The dense families of issue 35 from GGUF files written as llama.cpp's convert_hf_to_gguf.py
writes them (its metadata keys per architecture, gguf-py's tensor names, its Q/K permutation
and Gemma's `1 + w` norms, Phi-3's LongRoPE factor tensors): our GGUF run equals the HF run.
(scripts/check_gguf_converter.py runs the real converter where a llama.cpp tree is at hand.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
from pagedserve.models.loader import load_model
from utils import PagedRunner

VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0], "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0]}
_THETA = lambda theta: {"rope_type": "default", "rope_theta": theta}  # noqa: E731
CONFIGS = {
    "phi3": lambda: transformers.Phi3Config(**_COMMON, original_max_position_embeddings=16,
                                            rope_parameters=dict(_LONGROPE)),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=16,
                                                sliding_window=6, attn_logit_softcapping=1.5,
                                                final_logit_softcapping=4.0),
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    "granite": lambda: transformers.GraniteConfig(**_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.2, logits_scaling=2.5),
    "glm4": lambda: transformers.Glm4Config(**_COMMON, head_dim=16),
    "smollm3": lambda: transformers.SmolLM3Config(**_COMMON),
    "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
    "seed_oss": lambda: transformers.SeedOssConfig(**_COMMON, head_dim=16, attention_bias=True,
                                                   attention_out_bias=False, mlp_bias=True),
    # Command-R with Command R+'s per-head q/k norms; Cohere 2 with its default layer types
    # (RoPE bases other than HF's defaults, 500000 and 10000: the file's must be read)
    "command-r": lambda: transformers.CohereConfig(**_COMMON, use_qk_norm=True, attention_bias=True,
                                                   logit_scale=0.5, rope_parameters=_THETA(10000.0)),
    "cohere2": lambda: transformers.Cohere2Config(**_COMMON, sliding_window=4, logit_scale=0.25,
                                                  rope_parameters=_THETA(500.0)),
    # EXAONE 4.0, hybrid: sliding layers with RoPE, global ones without (every second: the
    # file's pattern must be read, llama.cpp's default is every fourth)
    "exaone4": lambda: transformers.Exaone4Config(**_COMMON, head_dim=16, sliding_window=4,
                                                  sliding_window_pattern=2),
    # Ministral 3 (YaRN from 4 positions, so the query temperature changes along the prompts)
    "mistral3": lambda: transformers.Ministral3Config(**_COMMON, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.5}),
    # ERNIE 4.5 dense: RoPE on pairs (Q/K not permuted), every projection biased
    "ernie4_5": lambda: transformers.Ernie4_5Config(**_COMMON, head_dim=16, use_bias=True),
    # HunYuan dense: q/k norms after RoPE, the checkpoints' NTK-alpha RoPE (the converter writes
    # the scaled base), attention biases
    "hunyuan-dense": lambda: transformers.HunYuanDenseV1Config(
        **_COMMON, head_dim=16, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}),
    # LFM2: two conv layers (their state a window of 3 rows of the cache) around an attention one
    "lfm2": lambda: transformers.Lfm2Config(**{**_COMMON, "intermediate_size": 192}, conv_L_cache=3,
                                            layer_types=["conv", "full_attention", "conv", "conv"],
                                            block_multiple_of=32, conv_bias=True),
}
_PERMUTED = ("granite", "smollm3", "mistral3")  # llama.cpp's LlamaModel subclasses


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer: gguf.GGUFWriter, arch: str, c) -> None:
    """The keys each family's converter class writes (set_gguf_parameters)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    if arch != "lfm2":
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    if arch == "lfm2":  # conversion/lfm2.py: KV heads per layer (0: conv), the adjusted MLP width
        writer.add_head_count_kv([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])
        writer.add_shortconv_l_cache(c.conv_L_cache)
        writer.add_vocab_size(c.vocab_size)
        ff = int(2 * c.intermediate_size / 3)
        ff = c.block_multiple_of * -(-int(c.block_ffn_dim_multiplier * ff) // c.block_multiple_of)
        writer.add_feed_forward_length(ff)
    else:
        writer.add_head_count_kv(c.num_key_value_heads)
    if arch in ("command-r", "cohere2"):  # LayerNorm: conversion/command_r.py
        writer.add_layer_norm_eps(c.layer_norm_eps)
        writer.add_logit_scale(c.logit_scale)
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:
        writer.add_layer_norm_rms_eps(c.norm_eps if arch == "lfm2" else c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # (OLMo 3's per layer type)
    if arch == "hunyuan-dense":  # conversion/hunyuan.py: base * alpha ** (d / (d - 2)), no scaling
        from pagedserve.models.hunyuan import hunyuan_rope_parameters

        rope = hunyuan_rope_parameters(c)
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1)
    if arch != "phi3":
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "olmo2" and getattr(c, "sliding_window", None):  # OLMo 3: conversion/olmo.py
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        if rope.get("rope_type") == "yarn":  # the base class's rope keys (of the full layers)
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("granite", "smollm3"):
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch in ("gemma2", "gemma", "glm4", "seed_oss", "cohere2", "ernie4_5", "hunyuan-dense"):  # (a head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "phi3":
        rope_dims = int(c.rope_parameters["partial_rotary_factor"] * c.hidden_size) // c.num_attention_heads
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_sliding_window(0)
        writer.add_rope_scaling_attn_factors(1.0)
    elif arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
    elif arch == "granite":
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    elif arch == "glm4":
        writer.add_rope_dimension_count(int(head_dim * 0.5))
    elif arch == "cohere2":
        writer.add_sliding_window(c.sliding_window)
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(head_dim)
        default = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(c.num_hidden_layers)]
        if list(c.layer_types) != default:  # NOTE: the converter writes none (llama.cpp reads one)
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    elif arch == "exaone4":  # conversion/exaone.py's Exaone4Model
        writer.add_vocab_size(c.vocab_size)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    elif arch == "mistral3":  # conversion/mistral3.py: the base class's YaRN keys, Ministral 3's two
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if c.model_type == "ministral3":
            writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
            writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_family_gguf(path, arch: str, hf_model, qtype=gguf.GGMLQuantizationType.F32):
    """`hf_model` as llama.cpp's converter writes it; 2-D weights as `qtype`."""
    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _metadata(writer, arch, c)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], c.num_hidden_layers)
    tied = getattr(c, "tie_word_embeddings", False)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and (tied or arch in ("gemma2", "gemma")):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.detach().numpy().astype(np.float32)
        if arch in _PERMUTED and ".q_proj." in hf_name:
            data = _permute(data, c.num_attention_heads)
        if arch in _PERMUTED and ".k_proj." in hf_name:
            data = _permute(data, c.num_key_value_heads)
        if arch in ("gemma2", "gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        if arch == "lfm2" and hf_name.endswith("conv.conv.weight"):
            data = data.squeeze(1)  # [C, L]
        name = f"{name_map.get_name(base)}.{suffix}"
        quantizable = data.ndim == 2 and "embed" not in hf_name and "norm" not in hf_name  # (Cohere's q/k norms: 2-D)
        if qtype != gguf.GGMLQuantizationType.F32 and quantizable:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    if arch == "phi3":  # generate_extra_tensors
        writer.add_tensor("rope_factors_long.weight", np.array(c.rope_parameters["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(c.rope_parameters["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path, tmp_path, keep_quantized=False):
    config = load_gguf_config(path, cache_dir=tmp_path / "cache")
    weights = iter_gguf_weights(path, config, keep_quantized=keep_quantized)
    dtype = torch.bfloat16 if keep_quantized else torch.float32
    return config, load_model(config, weights=weights, dtype=dtype, quantization="gguf" if keep_quantized else "none")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_family_gguf_equals_the_hf_run(arch, hf_pair, check_hf, prompts, tmp_path):
    hf, ours_hf, _ = hf_pair(CONFIGS[arch]())
    path = write_family_gguf(tmp_path / f"{arch}.gguf", arch, hf)
    config, model = _load(path, tmp_path)
    assert type(model) is type(ours_hf)
    assert config.num_hidden_layers == 4 and config.vocab_size == VOCAB
    lengths = (20, 17, 25) if arch == "phi3" else (13, 5, 9)  # phi3 serves 64 > 16: long factors
    check_hf(hf, model, prompts(VOCAB, lengths=lengths))


def test_phi3_q8_0_gguf_keeps_fused_tensors_as_blocks_split_by_rows(hf_pair, tmp_path):
    """Q8_0 `attn_qkv` / `ffn_up` load as blocks split into q/k/v and gate/up rows; the
    quantized bf16 model's greedy token is in the HF model's top 5 at every position."""
    hf, _, _ = hf_pair(CONFIGS["phi3"]())
    path = write_family_gguf(tmp_path / "phi3-q8.gguf", "phi3", hf, gguf.GGMLQuantizationType.Q8_0)
    _, model = _load(path, tmp_path, keep_quantized=True)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.dtype == torch.uint8 and attn.k_proj.weight.quant.format.name == "q8_0"
    assert_greedy_in_hf_top5(hf, model)


def assert_greedy_in_hf_top5(hf, model, n: int = 20) -> None:
    """A quantized model's greedy token is in the HF model's top 5 at every position of an
    `n`-token prompt."""
    tokens = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = PagedRunner(model).step([(0, tokens)])[0].float()  # [n, V]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens])).logits[0]  # [n, V]
    top5 = ref.topk(5, dim=-1).indices
    assert all(int(ours[i].argmax()) in top5[i].tolist() for i in range(n))
