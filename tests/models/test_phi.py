"""Our Phi-1.5 / Phi-2 (parallel block with one LayerNorm, partial RoPE, biases everywhere, a
gelu_new MLP, an LM head bias; optional per-head q/k LayerNorm) equals HF transformers in
float32."""

import pytest
import transformers

from pagedserve.models.phi import PhiForCausalLM

VOCAB = 300


def phi_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.PhiConfig(**kwargs)


@pytest.mark.parametrize("rotary,qk_layernorm,kv_heads", [(0.5, False, 4), (1.0, True, 2)],
                         ids=["phi2", "qk-layernorm-gqa"])
def test_phi_matches_hf(hf_pair, check_hf, prompts, rotary, qk_layernorm, kv_heads):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary}
    hf, model, _ = hf_pair(phi_config(rope_parameters=rope, qk_layernorm=qk_layernorm,
                                      num_key_value_heads=kv_heads))
    assert isinstance(model, PhiForCausalLM)
    assert model.model.rotary_emb.rotary_dim == int(16 * rotary)
    attn = model.model.layers[0].self_attn
    assert (attn.q_norm is not None) == qk_layernorm and attn.o_proj.bias is not None
    assert model.lm_head_bias is not None and not model.tied
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
