"""Our text decoders of Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints equal HF transformers'
multimodal models on text-only inputs in float32 (M-RoPE with one position for its three
sections is the 1D RoPE; the vision tower is skipped)."""

import pytest
import transformers

from pagedserve.models.qwen_vl import (
    Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
    text_only_rope)

VOCAB = 300
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
              out_hidden_size=64)


def _config(kind: str):
    if kind == "qwen3_vl":
        text = dict(TEXT, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        return transformers.Qwen3VLConfig(text_config=text, vision_config=dict(VISION, num_position_embeddings=16),
                                          image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
                                          vision_start_token_id=VOCAB - 3)
    text = dict(TEXT, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    cls = transformers.Qwen2VLConfig if kind == "qwen2_vl" else transformers.Qwen2_5_VLConfig
    vision = dict(embed_dim=32, depth=1, num_heads=2, hidden_size=64, patch_size=14) if kind == "qwen2_vl" \
        else dict(VISION)
    return cls(text_config=text, vision_config=vision, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
               vision_start_token_id=VOCAB - 3)


HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
              "qwen3_vl": "Qwen3VLForConditionalGeneration"}
OURS = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration}


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_qwen_vl_text_decoder_matches_hf_on_text(hf_pair, check_hf, prompts, kind):
    hf, model, _ = hf_pair(_config(kind), hf_class=getattr(transformers, HF_CLASSES[kind]))
    assert type(model) is OURS[kind]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_text_only_rope_drops_the_sections_and_names_mrope_default():
    config = transformers.Qwen2_5_VLConfig(text_config=dict(TEXT, rope_parameters={
        "rope_type": "mrope", "rope_theta": 5.0, "mrope_section": [2, 3, 3]}))
    text = text_only_rope(config.get_text_config())
    assert text.rope_parameters == {"rope_type": "default", "rope_theta": 5.0}
    assert config.get_text_config().rope_parameters["mrope_section"] == [2, 3, 3]  # a copy changed
