"""Our Mixtral (softmax router, top-2 renormalized, SwiGLU experts w1/w3/w2, sliding window)
equals HF transformers in float32."""

import transformers

from pagedserve.models.mixtral import MixtralForCausalLM

VOCAB = 300


def mixtral_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, sliding_window=7, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.MixtralConfig(**kwargs)


def test_mixtral_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(mixtral_config())
    assert isinstance(model, MixtralForCausalLM)
    moe = model.model.layers[0].mlp
    assert moe.experts.gate_proj.shape == (8, 32, 64) and moe.experts.down_proj.shape == (8, 64, 32)
    check_hf(hf, model, prompts(VOCAB))


def test_mixtral_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(mixtral_config(sliding_window=None))
    check_gguf_family("mixtral", hf, folder, tmp_path, prompts(VOCAB), check_hf)
