"""Our MiniCPM3 (DeepSeek V2's latent attention with rotate-half RoPE, MiniCPM's scale_emb /
scale_depth / dim_model_base multipliers, a dense MLP) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.models.minicpm3 import MiniCPM3ForCausalLM

VOCAB = 300


def minicpm3_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, scale_emb=3.0, scale_depth=1.4,
                  dim_model_base=16, max_position_embeddings=128, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.MiniCPM3Config(**kwargs)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "dense_q"])
def test_minicpm3_latent_attention_and_multipliers_match_hf(hf_pair, check_hf, prompts, q_lora_rank):
    hf, model, _ = hf_pair(minicpm3_config(q_lora_rank=q_lora_rank))
    assert isinstance(model, MiniCPM3ForCausalLM)
    layer = model.model.layers[0]
    assert not layer.self_attn.rope_interleave and layer.residual_scale == 1.4 / 2 ** 0.5
    assert model.model.scale_emb == 3.0 and model.model.logits_scaling == 4.0
    check_hf(hf, model, prompts(VOCAB))


def test_minicpm3_longrope_matches_hf(hf_pair, check_hf, prompts):
    """MiniCPM3-4B's LongRoPE (short / long factors per rotary frequency, from 4 positions: every prompt longer, so HF takes the long factors as we do)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
            "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0]}
    hf, model, _ = hf_pair(minicpm3_config(rope_parameters=rope))
    check_hf(hf, model, prompts(VOCAB))


def test_minicpm3_with_experts_is_refused():
    with pytest.raises(ValueError, match="n_routed_experts"):
        MiniCPM3ForCausalLM(minicpm3_config(n_routed_experts=4))


def write_minicpm3_gguf(path, hf_model, qtype):
    """`hf_model` as convert_hf_to_gguf.py's MiniCPM3Model writes it (architecture "minicpm3"):
    its sizes and MLA keys only (no multipliers, base, value width: llama.cpp fixes them),
    gguf-py's names, Q/K not permuted, LongRoPE's factors as tensors; 2-D weights as `qtype`."""
    import gguf
    import numpy as np

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "minicpm3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MINICPM3, c.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        data = tensor.detach().float().numpy()
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and "embed" not in hf_name:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    rope = c.rope_parameters
    if rope.get("rope_type") == "longrope":  # generate_extra_tensors
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# llama.cpp's fixed multipliers and value width (src/models/minicpm3.cpp); a q_lora rank of 32
# (Q8_0 rows are blocks of 32)
_GGUF = dict(scale_emb=12.0, scale_depth=1.4, dim_model_base=256, v_head_dim=16, q_lora_rank=32)


@pytest.mark.parametrize("longrope", [False, True], ids=["default_rope", "longrope"])
def test_minicpm3_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, longrope):
    """llama.cpp's "minicpm3" GGUF: F32 equals HF; Q8_0 blocks kept give HF's greedy tokens by
    the tie rule. LongRoPE: the factors' tensors, the file's context as the original one (short
    factors served, as HF's within it)."""
    import gguf
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
            "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0]} if longrope else None
    hf, _, _ = hf_pair(minicpm3_config(**_GGUF, **({"rope_parameters": rope} if rope else {})))
    f32 = write_minicpm3_gguf(tmp_path / "f32.gguf", hf, gguf.GGMLQuantizationType.F32)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert isinstance(model, MiniCPM3ForCausalLM) and model.model.scale_emb == 12.0
    check_hf(hf, model, prompts(VOCAB))
    q8 = write_minicpm3_gguf(tmp_path / "q8.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "minicpm3 Q8_0")
