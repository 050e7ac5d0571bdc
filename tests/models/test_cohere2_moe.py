"""Our Cohere 2 MoE (Cohere 2's parallel block with RoPE on interleaved pairs on the sliding layers,
a dense prefix layer rotated by `force_rope`, experts weighed by the softmax or the sigmoids of
the top-k logits, shared experts averaged with or added to the routed ones, LayerNorm or RMSNorm,
the logit scale) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.models.cohere2_moe import Cohere2MoeBlock, Cohere2MoeForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def cohere2_moe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, prefix_dense_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, sliding_window=4,
        sliding_window_pattern=2, logit_scale=0.5, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Cohere2MoeConfig(**kwargs)


SIGMOID = {"expert_selection_fn": "sigmoid", "norm_topk_prob": True, "shared_expert_combination_strategy": "sum",
           "rms_norm_eps": 1e-6, "attention_bias": True, "prefix_dense_sliding_window_pattern": 2,
           "tie_word_embeddings": False}


@pytest.mark.parametrize("overrides", [{}, SIGMOID], ids=["softmax-average-layernorm", "sigmoid-sum-rmsnorm"])
def test_cohere2_moe_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(cohere2_moe_config(**overrides))
    assert isinstance(model, Cohere2MoeForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP] + [Cohere2MoeBlock] * 3
    assert layers[0].mlp.gate_proj.weight.shape[0] == 96  # prefix_dense_intermediate_size
    # softmax: the prefix layer is full attention, rotated (force_rope); sigmoid: it is sliding
    windows = [None if not overrides else 4, 4, None, 4]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
    assert [layer.self_attn.use_rope for layer in layers] == [True, True, False, True]
    moe = layers[1].mlp
    assert moe.routing.scoring == ("sigmoid_topk" if overrides else "softmax_topk")
    assert moe.combination == ("sum" if overrides else "average") and moe.shared_expert is not None
    assert type(layers[0].input_layernorm).__name__ == ("RMSNorm" if overrides else "CohereLayerNorm")
    assert model.logit_scale == 0.5
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_cohere2_moe_refuses_unknown_options():
    with pytest.raises(ValueError, match="expert_selection_fn"):
        Cohere2MoeForCausalLM(cohere2_moe_config(expert_selection_fn="relu"))
    config = cohere2_moe_config()
    config.shared_expert_combination_strategy = "max"
    with pytest.raises(ValueError, match="shared_expert_combination_strategy"):
        Cohere2MoeForCausalLM(config)


@pytest.mark.parametrize("overrides", [{}, {"expert_selection_fn": "sigmoid", "rms_norm_eps": 1e-6}],
                         ids=["softmax-layernorm", "sigmoid-rmsnorm"])
def test_cohere2_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, overrides):
    """llama.cpp's "cohere2moe" GGUF (the norm's kind by its epsilon key, the layer pattern as
    flags, the dense prefix's width as feed_forward_length and the experts' as
    expert_feed_forward_length, the selection as expert_gating_func; its force_rope on the dense
    prefix is HF's with prefix_dense_sliding_window_pattern 1) equals the HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(cohere2_moe_config(**overrides))
    check_gguf_family("cohere2_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
