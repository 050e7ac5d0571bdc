"""Our Nemotron (layernorm1p, partial RoPE, relu^2 MLP, optional biases) equals HF
transformers in float32."""

import pytest
import transformers

from pagedserve.models.nemotron import NemotronForCausalLM

VOCAB = 300


@pytest.mark.parametrize("rotary,bias", [(0.5, False), (1.0, True)], ids=["minitron", "full-rope-biases"])
def test_nemotron_matches_hf(hf_pair, check_hf, prompts, rotary, bias):
    config = transformers.NemotronConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=128, attention_bias=bias,
                                         mlp_bias=bias, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": rotary})
    hf, model, _ = hf_pair(config)
    assert isinstance(model, NemotronForCausalLM)
    assert model.model.rotary_emb.rotary_dim == int(16 * rotary)
    assert (model.model.layers[0].mlp.down_proj.bias is not None) == bias
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
