"""Our ERNIE 4.5 dense (`Ernie4_5ForCausalLM`: RoPE on interleaved pairs, `use_bias` on every
projection, tied embeddings) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.ernie4_5 import Ernie4_5ForCausalLM

VOCAB = 300


def ernie4_5_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Ernie4_5Config(**kwargs)


@pytest.mark.parametrize("use_bias,tied", [(False, True), (True, False)], ids=["plain-tied", "biases-untied"])
def test_ernie4_5_matches_hf(hf_pair, check_hf, prompts, use_bias, tied):
    hf, model, _ = hf_pair(ernie4_5_config(use_bias=use_bias, tie_word_embeddings=tied))
    assert isinstance(model, Ernie4_5ForCausalLM)
    assert model.model.rotary_emb.interleaved and model.model.layers[0].self_attn.rope_interleaved
    layer = model.model.layers[1]
    assert (layer.self_attn.o_proj.bias is not None) == use_bias
    assert (layer.mlp.down_proj.bias is not None) == use_bias
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    check_hf(hf, model, prompts(VOCAB))
