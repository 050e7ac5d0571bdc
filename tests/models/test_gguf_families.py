"""GGUF files of DeepSeek V2 / V3 ("deepseek2") and gpt-oss ("gpt-oss") as llama.cpp's
convert_hf_to_gguf.py writes them (names, metadata, kv_b split into attn_k_b / attn_v_b,
stacked experts, MXFP4 experts), written here with the `gguf` package, load to what HF
computes. scripts/check_llama_cpp_gguf.py checks the real converter's files the same way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from utils import PagedRunner

from pagedserve.layers.mxfp4 import dequantize_hf, pack_hf
from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
from pagedserve.models.loader import load_model

_spec = importlib.util.spec_from_file_location("models_conftest_helpers", Path(__file__).with_name("conftest.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)

Q = gguf.GGMLQuantizationType
VOCAB = 300
needs_moe = pytest.mark.skipif(importlib.util.find_spec("pagedserve.layers.moe") is None,
                               reason="layers/moe.py not merged yet")

# HF leaf (under model.layers.N.) -> llama.cpp's, as its converter maps them
_DS2 = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_OSS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_tensors(arch: str, config, state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, Q]]:
    """llama.cpp's tensors of an HF state dict: {gguf name: (float32 values, type)}."""
    out: dict[str, tuple[np.ndarray, Q]] = {}
    for name, t in state.items():
        base, suffix = name.rsplit(".", 1)
        if base in _TOP:
            out[f"{_TOP[base]}.{suffix}"] = (t.numpy(), Q.F32)
            continue
        layer, leaf = int(name.split(".")[2]), name.split(".", 3)[3].rsplit(".", 1)[0]
        blk = f"blk.{layer}"
        if arch == "deepseek2" and leaf == "self_attn.kv_b_proj":  # split, k_b transposed
            h, dn, dv = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
            kv = t.view(h, dn + dv, -1)
            out[f"{blk}.attn_k_b.weight"] = (kv[:, :dn].transpose(1, 2).contiguous().numpy(), Q.F32)
            out[f"{blk}.attn_v_b.weight"] = (kv[:, dn:].contiguous().numpy(), Q.F32)
        elif arch == "deepseek2" and leaf == "mlp.experts":  # HF's in-memory stacks
            if suffix == "gate_up_proj":  # [E, 2I, H]: gate, then up
                gate, up = t.chunk(2, dim=1)
                out[f"{blk}.ffn_gate_exps.weight"] = (gate.contiguous().numpy(), Q.F32)
                out[f"{blk}.ffn_up_exps.weight"] = (up.contiguous().numpy(), Q.F32)
            else:  # down_proj [E, H, I]
                out[f"{blk}.ffn_down_exps.weight"] = (t.numpy(), Q.F32)
        elif leaf == "mlp.gate" and suffix == "e_score_correction_bias":
            out[f"{blk}.exp_probs_b.bias"] = (t.numpy(), Q.F32)
        elif arch == "gpt-oss" and leaf == "self_attn" and suffix == "sinks":
            out[f"{blk}.attn_sinks.weight"] = (t.numpy(), Q.F32)
        elif arch == "gpt-oss" and leaf == "mlp" and suffix.startswith(("gate_up_proj", "down_proj")):
            raise AssertionError("gpt-oss experts are written by the test")
        else:
            names = _DS2 if arch == "deepseek2" else _OSS
            out[f"{blk}.{names[leaf]}.{suffix}"] = (t.numpy(), Q.F32)
    return out


def _write(path: Path, arch: str, config, tensors: dict[str, tuple[np.ndarray, Q]], meta) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_head_count(config.num_attention_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    meta(w)
    for name, (data, qtype) in tensors.items():
        data = np.ascontiguousarray(data, dtype=np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _deepseek2_meta(config):
    def meta(w):
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count_kv(1)  # MLA as MQA
        w.add_rope_freq_base(10000.0)
        w.add_leading_dense_block_count(config.first_k_dense_replace)
        w.add_kv_lora_rank(config.kv_lora_rank)
        if config.q_lora_rank:
            w.add_q_lora_rank(config.q_lora_rank)
        w.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        w.add_value_length(config.kv_lora_rank)
        w.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
        w.add_value_length_mla(config.v_head_dim)
        w.add_rope_dimension_count(config.qk_rope_head_dim)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_count(config.n_routed_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_shared_count(config.n_shared_experts)
        w.add_expert_weights_scale(config.routed_scaling_factor)
        if config.norm_topk_prob:
            w.add_expert_weights_norm(True)
        w.add_expert_group_count(config.n_group)
        w.add_expert_group_used_count(config.topk_group)
        if config.model_type == "deepseek_v3":
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    return meta


def _hf(config, seed=0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _helpers.randomize_(hf)
    return hf.eval()


def _check(hf, model, prompts, tol=1e-3):
    for p in prompts:
        ref = _helpers.hf_logits(hf, p)
        out = PagedRunner(model).step([(0, p)])[0]
        assert (out - ref).abs().max() < tol


def _mla_config(cls, **over):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
                tie_word_embeddings=False, n_routed_experts=4, moe_intermediate_size=32,
                num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1)
    base.update(over)
    return cls(**base)


def test_deepseek2_gguf_dense_mla(tmp_path, prompts):
    """MLA's tensors (kv_b split into attn_k_b / attn_v_b, joined back) and its config."""
    config = _mla_config(transformers.DeepseekV2Config, q_lora_rank=None, first_k_dense_replace=2)
    hf = _hf(config)
    path = _write(tmp_path / "ds2.gguf", "deepseek2", config,
                  _gguf_tensors("deepseek2", config, hf.state_dict()), _deepseek2_meta(config))
    ours = load_gguf_config(path, cache_dir=tmp_path)
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
                "num_attention_heads", "first_k_dense_replace"):
        assert getattr(ours, key) == getattr(config, key), key
    assert ours.model_type == "deepseek_v2"
    model = load_model(ours, weights=iter_gguf_weights(path, ours), dtype=torch.float32)
    _check(hf, model, prompts(VOCAB, lengths=(13, 6)))


@needs_moe
def test_deepseek3_gguf_moe_with_correction_bias(tmp_path, prompts):
    """V3: sigmoid gating, exp_probs_b (the correction bias), groups, stacked experts."""
    config = _mla_config(transformers.DeepseekV3Config, q_lora_rank=24, first_k_dense_replace=1,
                         norm_topk_prob=True, routed_scaling_factor=2.0)
    hf = _hf(config)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(4) * 0.5)
    path = _write(tmp_path / "ds3.gguf", "deepseek2", config,
                  _gguf_tensors("deepseek2", config, hf.state_dict()), _deepseek2_meta(config))
    ours = load_gguf_config(path, cache_dir=tmp_path)
    assert ours.model_type == "deepseek_v3" and ours.topk_method == "noaux_tc"
    model = load_model(ours, weights=iter_gguf_weights(path, ours), dtype=torch.float32)
    _check(hf, model, prompts(VOCAB, lengths=(13, 6)))


@needs_moe
def test_gpt_oss_gguf_mxfp4_experts_kept_as_blocks(tmp_path, prompts):
    """Split gate / up experts with biases, MXFP4 experts (kept as blocks), sinks, the router's
    bias, llama.cpp's fixed sliding-window pattern and YaRN."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256, tie_word_embeddings=False)
    hf = _hf(config)
    state = {k: v for k, v in hf.state_dict().items() if ".mlp.experts." not in k}
    tensors = _gguf_tensors("gpt-oss", config, state)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            e = layer.mlp.experts
            gu = e.gate_up_proj.transpose(1, 2)  # [E, 2I, H]
            for proj, w in (("gate", gu[:, 0::2]), ("up", gu[:, 1::2]), ("down", e.down_proj.transpose(1, 2))):
                values = dequantize_hf(*pack_hf(w))  # what MXFP4 keeps of them
                tensors[f"blk.{i}.ffn_{proj}_exps.weight"] = (values.numpy(), Q.MXFP4)
                w.copy_(values)  # the HF reference gets them too (views of its parameters)
            tensors[f"blk.{i}.ffn_gate_exps.bias"] = (e.gate_up_proj_bias[:, 0::2].numpy(), Q.F32)
            tensors[f"blk.{i}.ffn_up_exps.bias"] = (e.gate_up_proj_bias[:, 1::2].numpy(), Q.F32)
            tensors[f"blk.{i}.ffn_down_exps.bias"] = (e.down_proj_bias.numpy(), Q.F32)

    def meta(w):
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(16)
        w.add_value_length(16)
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(config.rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_sliding_window(config.sliding_window)
        w.add_expert_feed_forward_length(config.intermediate_size)

    path = _write(tmp_path / "oss.gguf", "gpt-oss", config, tensors, meta)
    ours = load_gguf_config(path, cache_dir=tmp_path)
    assert ours.layer_types == ["sliding_attention", "full_attention"]
    model = load_model(ours, weights=iter_gguf_weights(path, ours, keep_quantized=True), dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_proj.dtype == torch.uint8 and experts.gate_proj.quant.format.name == "mxfp4"
    dense = load_model(ours, weights=iter_gguf_weights(path, ours), dtype=torch.float32)
    _check(hf, dense, prompts(VOCAB, lengths=(13, 6)))  # dequantized: HF's values exactly
    for p in prompts(VOCAB, lengths=(11,)):  # kept: within the 8-bit activations' rounding
        ref, out = _helpers.hf_logits(hf, p), PagedRunner(model).step([(0, p)])[0]
        assert (out - ref).abs().max() < 0.05 * ref.abs().max()
