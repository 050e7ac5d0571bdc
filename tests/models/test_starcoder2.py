"""Our StarCoder 2 (LayerNorms with biases, biased projections, a plain gelu MLP, a sliding
window on every layer) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.models.starcoder2 import Starcoder2ForCausalLM

VOCAB = 300


def starcoder2_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Starcoder2Config(**kwargs)


@pytest.mark.parametrize("window,bias", [(4, True), (None, False)], ids=["window-bias", "full-nobias"])
def test_starcoder2_matches_hf(hf_pair, check_hf, prompts, window, bias):
    hf, model, _ = hf_pair(starcoder2_config(sliding_window=window, use_bias=bias))
    assert isinstance(model, Starcoder2ForCausalLM)
    spec = SlidingWindowSpec if window else FullAttentionSpec
    assert all(isinstance(s, spec) for s in model.kv_cache_spec.layer_specs())
    layer = model.model.layers[0]
    assert (layer.self_attn.o_proj.bias is not None) == bias and (layer.mlp.up_proj.bias is not None) == bias
    assert layer.input_layernorm.bias is not None and model.tied
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
