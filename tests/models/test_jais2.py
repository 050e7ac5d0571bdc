"""Our Jais 2 (LayerNorms with biases, a non-gated relu^2 MLP with biases, biased attention)
equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.models.jais2 import Jais2ForCausalLM

VOCAB = 300


@pytest.mark.parametrize("act,bias", [("relu2", True), ("gelu", False)], ids=["relu2-biases", "gelu-no-bias"])
def test_jais2_matches_hf(hf_pair, check_hf, prompts, act, bias):
    config = transformers.Jais2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, hidden_act=act, attention_bias=bias,
                                      mlp_bias=bias, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, Jais2ForCausalLM)
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm) and isinstance(model.model.norm, torch.nn.LayerNorm)
    assert (layer.mlp.up_proj.bias is not None) == bias and (layer.self_attn.o_proj.bias is not None) == bias
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
