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


# Qwen3-VL-MoE's experts: H = 64, I = 48 (so that the two stored layouts have different shapes)
MOE = dict(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2)


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
    assert tuple(shape) == (4, 64, 96)  # [E, H, 2I]
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
