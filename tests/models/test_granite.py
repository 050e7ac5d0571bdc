"""Our Granite (embedding, residual, attention and logit multipliers) equals HF transformers."""

import torch
import transformers

from pagedserve.models.granite import GraniteForCausalLM

VOCAB = 300


def test_granite_multipliers_match_hf(hf_pair, check_hf, prompts):
    config = transformers.GraniteConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, GraniteForCausalLM)
    assert model.model.layers[0].self_attn.attn.scale == 0.2
    assert model.greedy_tokens(torch.zeros(1, 64)) is None  # argmax of the scaled logits
    check_hf(hf, model, prompts(VOCAB))
