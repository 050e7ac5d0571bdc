"""Llama checkpoints with each rope scaling HF configs carry load and equal HF transformers
(llama3 and old-style linear: tests/models/test_llama.py)."""

import pytest
import transformers

VOCAB = 300
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    # Qwen2.5 / gpt-oss style (original 8 of 64 positions, so the ramp and mscale both matter)
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "truncate": False},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8,
                    "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 8, "beta_slow": 1},
    # served to 64 > 8 positions: the long factors, as HF's forward over sequences past 8
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 8,
                 "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_llama_with_rope_scaling_matches_hf(name, hf_pair, check_hf, prompts):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_theta": 1000.0, **ROPES[name]})
    hf, model, _ = hf_pair(config)
    rope = model.model.rotary_emb
    assert rope.rope_type == ROPES[name]["rope_type"]
    if name.startswith("yarn") or name == "longrope":
        assert rope.attention_scaling != 1.0
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 9, 20)))


def test_a_rope_option_we_do_not_implement_is_named_at_load():
    import torch

    from pagedserve.models.loader import load_model

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 4]})
    with pytest.raises(ValueError, match="mrope_section"):
        load_model(config, weights=None, dtype=torch.float32)
