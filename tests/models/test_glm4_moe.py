"""Our GLM-4.5 MoE (q/k/v biases without an o bias, per-head q/k norms, half-rotary RoPE in the
rotate-half layout, dense first layers, DeepSeek-V3's sigmoid grouped routing with a shared
expert) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.glm4_moe import Glm4MoeForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def glm4_moe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Glm4MoeConfig(**kwargs)


def _randomize_correction_bias(hf):
    """HF initializes e_score_correction_bias to zeros: give it values that move the choice."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-qk-norm"])
def test_glm4_moe_matches_hf(hf_pair, check_hf, prompts, qk_norm):
    hf, model, _ = hf_pair(glm4_moe_config(use_qk_norm=qk_norm), prepare=_randomize_correction_bias)
    assert isinstance(model, Glm4MoeForCausalLM)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [LlamaMLP, FusedMoE, FusedMoE]  # first_k_dense_replace
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert (attn.q_norm is not None) == qk_norm
    moe = model.model.layers[1].mlp
    assert moe.routing.scoring == "sigmoid" and moe.routing.num_groups == 2
    assert moe.routing.routed_scaling_factor == 2.5 and moe.shared_expert is not None
    assert torch.equal(moe.gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    check_hf(hf, model, prompts(VOCAB))


def test_glm4_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "glm4moe" GGUF (its block count including the multi-token-prediction layer,
    partial RoPE as rope.dimension_count, the routing as expert_* keys, the correction bias as
    exp_probs_b) equals the HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(glm4_moe_config(), prepare=_randomize_correction_bias)
    check_gguf_family("glm4_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
