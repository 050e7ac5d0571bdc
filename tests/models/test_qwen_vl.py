"""Our text decoders of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints equal HF
transformers' multimodal models on text-only inputs in float32 (M-RoPE with one position for its
three sections is the 1D RoPE; the vision tower is skipped; Qwen3-VL-MoE's fused experts in
either stored layout)."""

import pytest
import safetensors.torch
import torch
import transformers

from pagedserve.models.loader import iter_safetensors, load_model
from pagedserve.models.qwen_vl import (
    Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration, text_only_rope)

VOCAB = 300
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
              out_hidden_size=64)


# Qwen3-VL-MoE's experts: H = 64, I = 96 (the two stored layouts' shapes differ; rows of 32s for Q8_0)
MOE = dict(moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2)


def _config(kind: str):
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        text = dict(TEXT, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        cls = transformers.Qwen3VLConfig
        if kind == "qwen3_vl_moe":
            text, cls = dict(text, **MOE), transformers.Qwen3VLMoeConfig
        return cls(text_config=text, vision_config=dict(VISION, num_position_embeddings=16),
                   image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)
    text = dict(TEXT, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    cls = transformers.Qwen2VLConfig if kind == "qwen2_vl" else transformers.Qwen2_5_VLConfig
    vision = dict(embed_dim=32, depth=1, num_heads=2, hidden_size=64, patch_size=14) if kind == "qwen2_vl" \
        else dict(VISION)
    return cls(text_config=text, vision_config=vision, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
               vision_start_token_id=VOCAB - 3)


HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
              "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
OURS = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration, "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration}


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_qwen_vl_text_decoder_matches_hf_on_text(hf_pair, check_hf, prompts, kind):
    hf, model, _ = hf_pair(_config(kind), hf_class=getattr(transformers, HF_CLASSES[kind]))
    assert type(model) is OURS[kind]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def released_expert_layout(folder) -> None:
    """Rewrite the folder's fused experts as Qwen3-VL-MoE's released checkpoints store them:
    `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]` (transformers 5 saves its modules'
    `[E, 2I, H]` / `[E, H, I]`)."""
    path = folder / "model.safetensors"
    state = safetensors.torch.load_file(path)
    for name in [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        state[name] = state[name].transpose(1, 2).contiguous()
    safetensors.torch.save_file(state, path, metadata={"format": "pt"})


def test_qwen3_vl_moe_reads_the_released_expert_layout(hf_pair, check_hf, prompts):
    """The released checkpoints' `[E, H, 2I]` / `[E, I, H]` experts load as HF loads them (its
    conversion transposes them by their shapes): the same logits."""
    hf, _, folder = hf_pair(_config("qwen3_vl_moe"), hf_class=transformers.Qwen3VLMoeForConditionalGeneration)
    released_expert_layout(folder)
    shape = safetensors.torch.load_file(folder / "model.safetensors")[
        "model.language_model.layers.0.mlp.experts.gate_up_proj"].shape
    assert tuple(shape) == (4, 64, 192)  # [E, H, 2I]
    hf_released = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model = load_model(transformers.AutoConfig.from_pretrained(folder), weights=iter_safetensors(folder),
                       dtype=torch.float32)
    check_hf(hf_released.eval(), model, prompts(VOCAB, lengths=(13, 5, 9)))
    check_hf(hf, model, prompts(VOCAB, lengths=(7,)))  # (the model saved, as HF holds it)


def test_split_fused_experts_refuses_shapes_of_neither_layout():
    from pagedserve.models.fused_experts import split_fused_experts

    weights = [("model.layers.0.mlp.experts.down_proj", torch.zeros(4, 64, 50))]
    with pytest.raises(ValueError, match="fits neither"):
        list(split_fused_experts(weights, sizes=(64, 48)))


def test_text_only_rope_drops_the_sections_and_names_mrope_default():
    config = transformers.Qwen2_5_VLConfig(text_config=dict(TEXT, rope_parameters={
        "rope_type": "mrope", "rope_theta": 5.0, "mrope_section": [2, 3, 3]}))
    text = text_only_rope(config.get_text_config())
    assert text.rope_parameters == {"rope_type": "default", "rope_theta": 5.0}
    assert config.get_text_config().rope_parameters["mrope_section"] == [2, 3, 3]  # a copy changed


# --- GGUF: llama.cpp's "qwen2vl", "qwen3vl", "qwen3vlmoe" (the text model's file) ---------------

GGUF_ARCHS = {"qwen2_vl": "QWEN2VL", "qwen2_5_vl": "QWEN2VL", "qwen3_vl": "QWEN3VL", "qwen3_vl_moe": "QWEN3VLMOE"}
# our class for each GGUF: the decoder family it is (gguf_config's model types)
GGUF_CLASSES = {"qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM", "qwen3_vl": "Qwen3ForCausalLM",
                "qwen3_vl_moe": "Qwen3MoeForCausalLM"}


def gguf_tensors(hf_model) -> dict[str, torch.Tensor]:
    """The text decoder's tensors under llama.cpp's names, as its converter writes them: the
    vision tower left to the mmproj file, a tied LM head not written, Qwen3-VL-MoE's fused
    experts split into `ffn_{gate,up,down}_exps` `[E, out, in]` (conversion/qwen3vl.py)."""
    import gguf

    text, tied = hf_model.config.get_text_config(), hf_model.config.tie_word_embeddings
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHS[hf_model.config.model_type])
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    out = {}
    for name, t in hf_model.state_dict().items():
        name = name.replace("model.language_model.", "model.")
        if name.startswith("model.visual.") or (name == "lm_head.weight" and tied):
            continue
        base, suffix = name.rsplit(".", 1)
        if base.endswith(".mlp.experts"):  # transformers' modules: [E, 2I, H] / [E, H, I]
            blk = f"blk.{name.split('.')[2]}"
            if suffix == "gate_up_proj":
                gate, up = t.chunk(2, dim=1)  # 2 x [E, I, H]
                out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = gate, up
            else:
                out[f"{blk}.ffn_down_exps.weight"] = t
            continue
        mapped = names.get_name(base)
        assert mapped is not None, name
        out[f"{mapped}.{suffix}"] = t
    return out


def write_qwen_vl_gguf(path, hf_model, q8_0: bool = False, extra=None):
    """`hf_model`'s text decoder as llama.cpp's converter writes it (its metadata keys; with
    `q8_0`, every 2-D tensor but the embedding, the LM head and the router as Q8_0);
    `extra(writer)` adds (or overwrites) keys."""
    import gguf
    import numpy as np

    config, text = hf_model.config, hf_model.config.get_text_config()
    kind = config.model_type
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, GGUF_ARCHS[kind])])
    w.add_name(f"tiny {kind}")
    w.add_context_length(text.max_position_embeddings)
    w.add_embedding_length(text.hidden_size)
    w.add_block_count(text.num_hidden_layers)
    w.add_feed_forward_length(text.intermediate_size)
    w.add_head_count(text.num_attention_heads)
    w.add_head_count_kv(text.num_key_value_heads)
    w.add_rope_dimension_sections(list(text.rope_parameters["mrope_section"]) + [0])  # padded to 4
    w.add_rope_freq_base(text.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(text.rms_norm_eps)
    if kind.startswith("qwen3"):  # config.json's head_dim; Qwen3VLTextModel's deepstack count
        w.add_key_length(text.head_dim)
        w.add_value_length(text.head_dim)
        w.add_num_deepstack_layers(len(config.vision_config.deepstack_visual_indexes))
    if kind == "qwen3_vl_moe":
        w.add_expert_count(text.num_experts)
        w.add_expert_used_count(text.num_experts_per_tok)
        w.add_expert_feed_forward_length(text.moe_intermediate_size)
    if extra is not None:
        extra(w)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(text.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in gguf_tensors(hf_model).items():
        data = t.detach().float().numpy()
        if q8_0 and data.ndim >= 2 and not name.startswith(("token_embd", "output")) and "gate_inp" not in name:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q), raw_dtype=q)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", list(GGUF_ARCHS))
def test_qwen_vl_gguf_f32_equals_hf_and_kept_q8_0_by_the_tie_rule(hf_pair, check_hf, prompts, tmp_path, kind):
    """The text model's GGUF (f32) gives HF's logits; Q8_0 kept as blocks, HF's greedy tokens
    by the tie rule."""
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    hf, _, _ = hf_pair(_config(kind), hf_class=getattr(transformers, HF_CLASSES[kind]))
    f32 = write_qwen_vl_gguf(tmp_path / f"{kind}-f32.gguf", hf)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert type(model).__name__ == GGUF_CLASSES[kind]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))

    q8 = write_qwen_vl_gguf(tmp_path / f"{kind}-q8.gguf", hf, q8_0=True)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    mlp = model.model.layers[-1].mlp
    kept = mlp.experts.gate_proj if kind == "qwen3_vl_moe" else mlp.down_proj.weight
    assert kept.dtype == torch.uint8 and kept.quant.format.name == "q8_0"
    check_greedy_tie_rule(hf, model, prompts(VOCAB, lengths=(13, 9)), f"{kind} Q8_0")


def test_qwen_vl_gguf_config_reads_the_text_decoder_and_checks_its_own_keys(hf_pair, tmp_path):
    """qwen3vlmoe's config is Qwen3-MoE's, renormalized, experts in every layer; a malformed
    `rope.dimension_sections` or partial RoPE is a ValueError naming the key."""
    from pagedserve.models.gguf_loader import load_gguf_config

    hf, _, _ = hf_pair(_config("qwen3_vl_moe"), hf_class=transformers.Qwen3VLMoeForConditionalGeneration)
    config = load_gguf_config(write_qwen_vl_gguf(tmp_path / "moe.gguf", hf), cache_dir=tmp_path / "cache")
    assert (config.model_type, config.num_experts, config.moe_intermediate_size, config.norm_topk_prob,
            config.head_dim, config.mlp_only_layers) == ("qwen3_moe", 4, 96, True, 16, [])
    bad_keys = (lambda w: w.add_rope_dimension_sections([2, -3, 3, 0]),
                lambda w: w.add_rope_dimension_count(8))
    for key, extra in zip(("rope.dimension_sections", "rope.dimension_count"), bad_keys):
        path = write_qwen_vl_gguf(tmp_path / f"bad-{key}.gguf", hf, extra=extra)
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_gguf_config(path, cache_dir=tmp_path / "cache")
