"""Our StableLM (LayerNorms, partial RoPE, optional q/k/v bias, optional per-head q/k
LayerNorms, optional parallel residual) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.stablelm import StableLmForCausalLM

VOCAB = 300


def stablelm_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.StableLmConfig(**kwargs)


@pytest.mark.parametrize("parallel,qk_layernorm,bias,rotary", [(False, False, True, 0.25), (True, True, False, 1.0)],
                         ids=["stablelm2-1.6b", "stablelm2-12b"])
def test_stablelm_matches_hf(hf_pair, check_hf, prompts, parallel, qk_layernorm, bias, rotary):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary}
    hf, model, _ = hf_pair(stablelm_config(use_parallel_residual=parallel, qk_layernorm=qk_layernorm,
                                           use_qkv_bias=bias, rope_parameters=rope))
    assert isinstance(model, StableLmForCausalLM)
    layer = model.model.layers[0]
    assert layer.parallel == parallel and (layer.post_attention_layernorm is None) == parallel
    assert (layer.self_attn.q_proj.bias is not None) == bias and layer.self_attn.o_proj.bias is None
    if qk_layernorm:  # one weight row per head, stacked from HF's norms.{i}
        assert layer.self_attn.q_norm.weight.shape == (4, 16) and layer.self_attn.k_norm.weight.shape == (2, 16)
        assert not (layer.self_attn.k_norm.weight == layer.self_attn.k_norm.weight[0]).all()
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
