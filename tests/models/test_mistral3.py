"""Our Ministral 3 (Mistral with YaRN and Llama 4's per-position query temperature), Mistral 3's
text decoder (both of its text model types) and Ministral (per-layer windows) equal HF
transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.models.llama import MinistralForCausalLM
from pagedserve.models.ministral3 import Ministral3ForCausalLM, attention_temperature
from pagedserve.models.mistral3 import (
    Mistral3ForConditionalGeneration, Mistral3Ministral3ForConditionalGeneration)
from pagedserve.models.registry import get_model_class

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def ministral3_config(beta=0.5, original=4, **overrides):
    """YaRN from an original length of `original` (so the test's positions cross it up to
    three times: the temperature takes three values besides 1)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": original, "max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": beta}
    return transformers.Ministral3Config(**{**COMMON, "rope_parameters": rope, **overrides})


def pixtral(**overrides):
    return dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14, **overrides)


def test_attention_temperature_is_one_below_the_original_length_and_hf_s_above():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    assert torch.equal(attention_temperature(torch.arange(16), 0.1, 16), torch.ones(16))
    assert attention_temperature(torch.arange(40), None, 16) is None
    pos = torch.tensor([0, 15, 16, 31, 32, 100])
    ours = attention_temperature(pos, 0.1, 16)
    assert torch.equal(ours, get_llama_4_attn_scale(pos[None], 0.1, 16)[0, 0, :, 0])
    assert ours[0] == 1 and ours[2] > 1


def test_ministral3_query_temperature_and_yarn_match_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(ministral3_config())
    assert type(model) is Ministral3ForCausalLM
    assert model.model.temperature_beta == 0.5 and model.model.temperature_length == 4
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_ministral3_without_temperature_crossing_is_mistral(hf_pair, check_hf, prompts):
    """Positions below the original length: the scale is exactly 1 (the fused decode path's
    case); the model still equals HF."""
    hf, model, _ = hf_pair(ministral3_config(original=64))
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("text", ["mistral", "ministral3"])
def test_mistral3_text_decoder_matches_hf(hf_pair, check_hf, prompts, text):
    text_config = (ministral3_config() if text == "ministral3"
                   else transformers.MistralConfig(**COMMON, sliding_window=None))
    config = transformers.Mistral3Config(text_config=text_config.to_dict(), vision_config=pixtral(),
                                         image_token_index=VOCAB - 1)
    hf, model, _ = hf_pair(config, hf_class=transformers.Mistral3ForConditionalGeneration)
    want = Mistral3Ministral3ForConditionalGeneration if text == "ministral3" \
        else Mistral3ForConditionalGeneration
    assert type(model) is want
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_mistral3_names_a_text_model_it_does_not_serve():
    config = transformers.Mistral3Config(
        text_config=transformers.Qwen3Config(**COMMON).to_dict(), vision_config=pixtral())
    with pytest.raises(ValueError, match="text_config.model_type 'qwen3'"):
        get_model_class(config)


def test_ministral_per_layer_windows_match_hf(hf_pair, check_hf, prompts):
    config = transformers.MinistralConfig(**COMMON, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention"])
    hf, model, _ = hf_pair(config)
    assert type(model) is MinistralForCausalLM
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [4, None]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_mistral3_gguf_without_temperature_is_mistral_and_keeps_q8_0_blocks(hf_pair, prompts, tmp_path):
    """llama.cpp's "mistral3" of Mistral Small 3.x (no temperature scale): Mistral with full
    attention; its Q8_0 projections load as blocks and the bf16 model's greedy token is in HF's
    top 5 at every position. (Ministral 3's file: test_gguf_dense_families.py.)"""
    import gguf
    from test_gguf_dense_families import _load, write_family_gguf

    from pagedserve.models.llama import MistralForCausalLM
    from utils import PagedRunner

    hf, _, _ = hf_pair(transformers.MistralConfig(**COMMON, sliding_window=None))
    path = write_family_gguf(tmp_path / "m.gguf", "mistral3", hf, gguf.GGMLQuantizationType.Q8_0)
    config, model = _load(path, tmp_path, keep_quantized=True)
    assert type(model) is MistralForCausalLM and config.sliding_window is None
    assert model.model.layers[0].self_attn.q_proj.weight.quant.format.name == "q8_0"
    tokens = prompts(VOCAB, lengths=(20,))[0]
    ours = PagedRunner(model).step([(0, tokens)])[0].float()  # [20, V]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens])).logits[0]  # [20, V]
    top5 = ref.topk(5, dim=-1).indices
    assert all(int(ours[i].argmax()) in top5[i].tolist() for i in range(len(tokens)))


def test_ministral3_scales_queries_only_in_steps_past_the_original_length(hf_pair, prompts, monkeypatch):
    """A step whose positions all lie below YaRN's original length runs the plain layer (the
    fused decode path's case: every scale is exactly 1); a longer one multiplies q."""
    from pagedserve.models.ministral3 import Ministral3DecoderLayer
    from utils import PagedRunner

    _, model, _ = hf_pair(ministral3_config(original=8))
    scaled = []
    unfused = Ministral3DecoderLayer.unfused

    def spy(self, x, rope, kv_cache, meta, q_scale=None):
        scaled.append(q_scale is not None)
        return unfused(self, x, rope, kv_cache, meta, q_scale)

    monkeypatch.setattr(Ministral3DecoderLayer, "unfused", spy)
    runner = PagedRunner(model)
    runner.step([(0, prompts(VOCAB, lengths=(6,))[0])])  # positions 0..5
    assert scaled and not any(scaled)
    runner.step([(0, [5, 6, 7])])  # positions 6..8: past 8 tokens of context
    assert all(scaled[-2:])
