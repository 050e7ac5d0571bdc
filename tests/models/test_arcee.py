"""Our Arcee (Llama with a non-gated relu^2 MLP) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.arcee import ArceeForCausalLM

VOCAB = 300


@pytest.mark.parametrize("bias", [False, True], ids=["afm", "biases"])
def test_arcee_matches_hf(hf_pair, check_hf, prompts, bias):
    config = transformers.ArceeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attention_bias=bias, mlp_bias=bias, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, ArceeForCausalLM)
    mlp = model.model.layers[0].mlp
    assert mlp.act_fn.name == "relu2" and not hasattr(mlp, "gate_proj") and (mlp.up_proj.bias is not None) == bias
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
