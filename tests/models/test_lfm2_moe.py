"""Our LFM2-MoE (LFM2's conv and attention layers, a sigmoid-routed mixture of experts with a
selection bias after the dense layers) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.lfm2_moe import Lfm2MoeForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def lfm2_moe_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, num_dense_layers=1, num_experts=8, num_experts_per_tok=3,
                  layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                  routed_scaling_factor=1.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Lfm2MoeConfig(**kwargs)


def _random_expert_bias(hf):
    """The selection bias is a zero buffer at init: draw it so that it moves the choice."""
    gen = torch.Generator().manual_seed(3)
    for layer in hf.model.layers[1:]:
        if getattr(layer.feed_forward, "use_expert_bias", False):
            layer.feed_forward.expert_bias.copy_(torch.randn(8, generator=gen) * 0.5)


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "use_expert_bias": False}],
                         ids=["bias-renorm", "plain"])
def test_lfm2_moe_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(lfm2_moe_config(**overrides), prepare=_random_expert_bias)
    assert isinstance(model, Lfm2MoeForCausalLM)
    layers = model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP) and isinstance(layers[1].mlp, FusedMoE)
    if overrides.get("use_expert_bias", True):
        assert torch.equal(layers[2].mlp.gate.e_score_correction_bias.float(),
                           hf.model.layers[2].feed_forward.expert_bias.float())
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_lfm2_moe_from_gguf_as_llama_cpp_writes_it(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's lfm2moe: per-layer KV head counts (0 on conv layers), the selection bias as
    exp_probs_b, experts merged per layer; F32 equals HF, Q8_0 experts kept as blocks."""
    from moe_gguf import check_gguf_family

    # (the converter writes no routed_scaling_factor: llama.cpp runs it as 1, LFM2-8B-A1B's)
    hf, _, folder = hf_pair(lfm2_moe_config(routed_scaling_factor=1.0), prepare=_random_expert_bias)
    check_gguf_family("lfm2_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
