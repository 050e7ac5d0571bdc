"""Our OLMo (weightless LayerNorms, q/k/v clamped to clip_qkv, optional attention biases)
equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.olmo import OlmoForCausalLM

VOCAB = 300


@pytest.mark.parametrize("clip,bias", [(None, False), (0.8, True)], ids=["plain", "clip-bias"])
def test_olmo_matches_hf(hf_pair, check_hf, prompts, clip, bias):
    config = transformers.OlmoConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     clip_qkv=clip, attention_bias=bias, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, OlmoForCausalLM)
    attn = model.model.layers[0].self_attn
    assert attn.clip_qkv == clip and (attn.o_proj.bias is not None) == bias
    assert not list(model.model.layers[0].input_layernorm.parameters())
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
