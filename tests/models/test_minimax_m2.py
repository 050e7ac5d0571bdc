"""Our MiniMax-M2 (whole-projection q/k RMSNorms, partial rotate-half RoPE, sigmoid routing chosen
with a selection bias and renormalized) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.minimax_m2 import MiniMaxM2Attention, MiniMaxM2ForCausalLM

VOCAB = 300


def minimax_m2_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=3, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.MiniMaxM2Config(**kwargs)


def _randomize_correction_bias(hf):
    """HF initializes the selection bias (a buffer of the MoE block) to zeros: draw values of the
    sigmoid scores' scale, so that it moves the choice."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)


@pytest.mark.parametrize("rotary", [0.5, 1.0], ids=["half-rotary", "full-rotary"])
def test_minimax_m2_matches_hf(hf_pair, check_hf, prompts, rotary):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary}
    hf, model, folder = hf_pair(minimax_m2_config(rope_parameters=rope), prepare=_randomize_correction_bias)
    assert isinstance(model, MiniMaxM2ForCausalLM)
    attn = model.model.layers[1].self_attn
    assert isinstance(attn, MiniMaxM2Attention) and attn.q_proj.bias is None and attn.o_proj.bias is None
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)  # whole projections
    assert model.model.rotary_emb.rotary_dim == int(16 * rotary)  # (half of) each head rotated
    moe = model.model.layers[1].mlp
    assert isinstance(moe, FusedMoE) and moe.routing.scoring == "sigmoid" and moe.routing.renormalize
    assert moe.routing.routed_scaling_factor == 1.0 and moe.routing.renormalize_eps == 0.0
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        assert torch.equal(ours.mlp.gate.e_score_correction_bias, theirs.mlp.e_score_correction_bias)
    # save_pretrained writes Mixtral's per-expert layout (HF 5's conversion mapping, reversed)
    from pagedserve.models.loader import iter_safetensors

    names = {n for n, _ in iter_safetensors(folder)}
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in names
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
    # a multi-token-prediction layer's tensors (past num_hidden_layers) are skipped
    assert model._rename("model.layers.3.block_sparse_moe.experts.0.w1.weight") is None
    assert model._rename("model.layers.2.block_sparse_moe.e_score_correction_bias") == \
        "model.layers.2.mlp.gate.e_score_correction_bias"


def test_minimax_m2_legacy_rotary_dim_config(hf_pair, check_hf, prompts):
    """MiniMax's released config.json: partial RoPE as `rotary_dim` (no partial_rotary_factor),
    `scoring_func` / `use_routing_bias` fields HF ignores; full-width experts routed 2 of 8."""

    def legacy(cfg):
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        cfg.pop("partial_rotary_factor", None)
        return {**cfg, "rotary_dim": 4, "scoring_func": "sigmoid", "use_routing_bias": True}

    hf, model, _ = hf_pair(minimax_m2_config(num_experts_per_tok=2), edit_config=legacy,
                           prepare=_randomize_correction_bias)
    assert hf.model.rotary_emb.inv_freq.shape == (2,)  # HF read rotary_dim 4 of 16
    assert model.model.rotary_emb.rotary_dim == 4
    check_hf(hf, model, prompts(VOCAB))


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("attention_bias", True),
                                         ("hidden_act", "gelu")])
def test_minimax_m2_unsupported_config_values(field, value):
    config = minimax_m2_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        MiniMaxM2ForCausalLM(config)


def test_minimax_m2_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "minimax-m2" GGUF (the rotated part as rope.dimension_count, head_dim as
    key_length, the selection bias as exp_probs_b, experts merged per layer, q/k unpermuted)
    equals the HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(minimax_m2_config(), prepare=_randomize_correction_bias)
    check_gguf_family("minimax_m2", hf, folder, tmp_path, prompts(VOCAB), check_hf)
