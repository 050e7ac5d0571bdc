"""Our LFM2 (gated short convolutions whose state is a sliding window of the paged cache, and
Qwen3-like attention layers) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.models.lfm2 import Lfm2ForCausalLM

VOCAB = 300


def lfm2_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3,
                  block_multiple_of=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Lfm2Config(**kwargs)


@pytest.mark.parametrize("overrides", [{}, {"conv_bias": True, "conv_L_cache": 4},
                                       {"num_key_value_heads": 1}],
                         ids=["lfm2", "bias-L4", "conv-over-two-pages"])
def test_lfm2_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(lfm2_config(**overrides))
    assert isinstance(model, Lfm2ForCausalLM)
    config = hf.config
    specs = model.kv_cache_spec.layer_specs()
    per_conv = 2 if overrides.get("num_key_value_heads") == 1 else 1  # 64 channels, pages of 32
    assert len(specs) == 1 + 3 * per_conv
    assert specs[per_conv] == FullAttentionSpec(config.num_key_value_heads, 16)
    assert specs[0] == SlidingWindowSpec(config.num_key_value_heads, 16, window=config.conv_L_cache)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_lfm2_mlp_width_follows_hf_adjustment(hf_pair):
    hf, model, _ = hf_pair(lfm2_config(intermediate_size=200, block_ffn_dim_multiplier=1.5))
    assert model.model.layers[0].mlp.gate_proj.weight.shape == hf.model.layers[0].feed_forward.w1.weight.shape


def test_lfm2_rejects_unknown_layer_types():
    with pytest.raises(ValueError, match="layer_types"):
        Lfm2ForCausalLM(lfm2_config(layer_types=["conv", "mamba", "conv", "conv"]))


def test_lfm2_pipeline_stage_refuses_more_cache_entries_than_layers():
    """A pipeline stage maps layers onto cache entries one to one: LFM2's conv rows span
    several entries (here 2 per conv layer), so a stage refuses it, naming the option."""
    from pagedserve.worker.pp_executor import _Stage

    model = Lfm2ForCausalLM(lfm2_config(num_key_value_heads=1))
    assert model.kv_cache_spec.num_layers == 7
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _Stage(model, 0, 2, True, False)
