"""Our EXAONE MoE (K-EXAONE: per-head q/k norms, sliding RoPE layers and global NoPE ones in a
pre-norm block, DeepSeek-V3's sigmoid grouped routing with a selection bias beside shared experts
after dense first layers) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.exaone_moe import ExaoneMoeForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def exaone_moe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, sliding_window=4, sliding_window_pattern=2,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.ExaoneMoeConfig(**kwargs)


def _correction_bias(hf):
    """HF initializes e_score_correction_bias to zeros: give it values that move the choice."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window_pattern": 4, "norm_topk_prob": False, "n_group": 1,
                                            "num_shared_experts": 2}],
                         ids=["grouped", "ungrouped-unnormalized"])
def test_exaone_moe_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(exaone_moe_config(**overrides), prepare=_correction_bias)
    assert isinstance(model, ExaoneMoeForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, FusedMoE, FusedMoE, FusedMoE]
    rope = [True, False] * 2 if "sliding_window_pattern" not in overrides else [True] * 3 + [False]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4 if r else None for r in rope]
    assert model.model.use_rope == rope  # the global layers: NoPE
    moe = layers[1].mlp
    assert moe.routing.scoring == "sigmoid" and moe.routing.correction_bias and moe.routing.router_fp32
    assert moe.routing.num_groups == overrides.get("n_group", 2)
    assert torch.equal(moe.gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert moe.shared_expert.gate_proj.weight.shape[0] == 32 * overrides.get("num_shared_experts", 1)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_exaone_moe_skips_the_mtp_weights():
    model = ExaoneMoeForCausalLM(exaone_moe_config())
    assert model._rename("mtp.layers.0.self_attn.q_proj.weight") is None
    assert model._rename("mtp.fc.weight") is None


def test_exaone_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "exaone-moe" GGUF (the layer types as a sliding-window pattern, the routing as
    expert_* keys, the selection bias as exp_probs_b) equals the HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(exaone_moe_config(), prepare=_correction_bias)
    check_gguf_family("exaone_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
