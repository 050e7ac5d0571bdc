"""Our Llama / Mistral equal HF transformers' logits, token for token."""

import transformers

from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM

VOCAB = 512


def tiny_llama(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return transformers.LlamaConfig(**{**base, **kw})


def test_llama_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    assert isinstance(model, LlamaForCausalLM)
    assert model.kv_cache_spec.num_kv_heads == 2 and model.kv_cache_spec.head_dim == 16
    check_hf(hf, model, prompts(VOCAB))


def test_llama31_rope_scaling_and_tied_head(hf_pair, check_hf, prompts):
    # original_max_position_embeddings=64 with head_dim 16 puts frequencies in all three llama3
    # bands (kept, smoothed, divided by factor).
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf, model, folder = hf_pair(tiny_llama(rope_parameters=rope, tie_word_embeddings=True, attention_bias=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_hf(hf, model, prompts(VOCAB))


def test_old_style_rope_theta_and_rope_scaling_config(hf_pair, check_hf, prompts):
    def old_style(cfg):
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = 300.0
        cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
        return cfg

    hf, model, _ = hf_pair(tiny_llama(), edit_config=old_style)
    assert model.model.rotary_emb.params["rope_type"] == "linear"
    assert model.model.rotary_emb.params["rope_theta"] == 300.0
    check_hf(hf, model, prompts(VOCAB))


def test_mistral_sliding_window_shorter_than_prompt(hf_pair, check_hf, prompts):
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    hf, model, _ = hf_pair(config)
    assert isinstance(model, MistralForCausalLM)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [6, 6]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))
