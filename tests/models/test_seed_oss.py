"""Our Seed-OSS (q/k/v, o and MLP biases switched apart) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.seed_oss import SeedOssForCausalLM

VOCAB = 300


@pytest.mark.parametrize("out_bias,mlp_bias", [(False, False), (True, True), (False, True)])
def test_seed_oss_bias_switches_match_hf(hf_pair, check_hf, prompts, out_bias, mlp_bias):
    config = transformers.SeedOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        attention_bias=True, attention_out_bias=out_bias, mlp_bias=mlp_bias,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, SeedOssForCausalLM)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.bias is not None
    assert (layer.self_attn.o_proj.bias is not None) == out_bias
    assert (layer.mlp.down_proj.bias is not None) == mlp_bias
    check_hf(hf, model, prompts(VOCAB))
