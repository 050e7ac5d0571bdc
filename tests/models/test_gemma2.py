"""Our Gemma 2 (attention and final-logit soft-capping, alternating sliding windows, Gemma norms)
equals HF transformers."""

import transformers

from pagedserve.models.gemma2 import Gemma2ForCausalLM

VOCAB = 300


def tiny_gemma2(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Gemma2Config(**{**base, **kw})


def test_gemma2_softcapping_and_windows_match_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_gemma2())
    assert isinstance(model, Gemma2ForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [6, None, 6, None]
    assert all(layer.self_attn.attn.softcap == 1.5 for layer in layers)
    assert model.final_softcap() == 4.0 and model.lm_head.weight is model.model.embed_tokens.weight
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))
