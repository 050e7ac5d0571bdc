"""Our Qwen3 (q/k RMSNorm per head, explicit head_dim) equals HF transformers."""

import transformers

from pagedserve.models.qwen3 import Qwen3ForCausalLM

VOCAB = 300


def test_qwen3_qk_norm_and_wide_heads(hf_pair, check_hf, prompts):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden_size // num_attention_heads
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf, model, _ = hf_pair(config)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.kv_cache_spec.head_dim == 32
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (32,) and attn.q_norm.weight.std() > 0  # randomized, so it matters
    check_hf(hf, model, prompts(VOCAB))
