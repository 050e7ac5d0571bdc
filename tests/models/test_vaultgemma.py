"""Our VaultGemma (Gemma 2 without the post-attention / post-feedforward norms: soft-capped
scores and logits, alternating sliding and global layers, Gemma norms, scaled embeddings) equals
HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.vaultgemma import VaultGemmaForCausalLM

VOCAB = 300


@pytest.mark.parametrize("softcap", [1.5, None], ids=["capped", "uncapped"])
def test_vaultgemma_matches_hf(hf_pair, check_hf, prompts, softcap):
    config = transformers.VaultGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        attn_logit_softcapping=softcap, final_logit_softcapping=4.0 if softcap else None,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, VaultGemmaForCausalLM)
    layer = model.model.layers[0]
    assert not hasattr(layer, "post_attention_layernorm") and not hasattr(layer, "post_feedforward_layernorm")
    assert [lyr.self_attn.attn.sliding_window for lyr in model.model.layers] == [4, None, 4, None]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
