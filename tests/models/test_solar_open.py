"""Our Solar Open (Llama's attention with q/k/v biases and no o bias, DeepSeek-V3's sigmoid grouped
routing with a selection bias beside shared experts in every layer) equals HF transformers in
float32; its GGUF (llama.cpp writes it as GLM-4.5 MoE) too."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.solar_open import SolarOpenForCausalLM

VOCAB = 300


def solar_open_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.SolarOpenConfig(**kwargs)


def _correction_bias(hf):
    """HF initializes e_score_correction_bias to zeros: give it values that move the choice."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "norm_topk_prob": False, "n_group": 1,
                                            "n_shared_experts": 2}],
                         ids=["grouped", "biases-ungrouped-unnormalized"])
def test_solar_open_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(solar_open_config(**overrides), prepare=_correction_bias)
    assert isinstance(model, SolarOpenForCausalLM)
    layers = model.model.layers
    assert all(type(layer.mlp) is FusedMoE for layer in layers)  # no dense layers
    attn = layers[0].self_attn
    assert attn.q_norm is None and attn.o_proj.bias is None
    assert (attn.q_proj.bias is not None) == bool(overrides.get("attention_bias"))
    moe = layers[0].mlp
    assert moe.routing.scoring == "sigmoid" and moe.routing.num_groups == overrides.get("n_group", 2)
    assert moe.routing.renormalize == overrides.get("norm_topk_prob", True)
    assert torch.equal(moe.gate.e_score_correction_bias, hf.model.layers[0].mlp.gate.e_score_correction_bias)
    assert moe.shared_expert.gate_proj.weight.shape[0] == 32 * overrides.get("n_shared_experts", 1)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_solar_open_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's Solar Open GGUF is a "glm4moe" file without leading_dense_block_count (nor
    feed_forward_length): it loads as GLM-4.5 MoE with experts in every layer and equals the HF
    folder. NOTE: the converter writes GLM's rotated part, `head_dim * partial_rotary_factor`
    with 0.5 where the rope parameters name none; HF's Solar Open then rotates whole heads and
    the file half of each (we follow the file): the factor is stated here."""
    from moe_gguf import check_gguf_family

    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0}
    hf, _, folder = hf_pair(solar_open_config(rope_parameters=rope), prepare=_correction_bias)
    check_gguf_family("glm4_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf, loads_as="Glm4MoeForCausalLM")
