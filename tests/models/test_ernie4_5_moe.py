"""Our ERNIE 4.5 MoE (RoPE on interleaved pairs, biases everywhere with `use_bias` but the routed
experts, a dense first layer, softmax routing chosen with a selection bias, shared experts, an
LM head bias) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def ernie_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, moe_num_shared_experts=1, moe_layer_start_index=1, use_bias=True,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Ernie4_5_MoeConfig(**kwargs)


def _randomize_selection_bias(hf):
    """HF initializes the correction bias to zeros: values that move the choice."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.rand(1, 8, generator=gen) * 0.3)


@pytest.mark.parametrize("use_bias", [True, False], ids=["use-bias", "no-bias"])
def test_ernie4_5_moe_matches_hf(hf_pair, check_hf, prompts, use_bias):
    hf, model, _ = hf_pair(ernie_config(use_bias=use_bias), prepare=_randomize_selection_bias)
    assert isinstance(model, Ernie4_5_MoeForCausalLM)
    assert [type(layer.mlp) for layer in model.model.layers] == [LlamaMLP, FusedMoE, FusedMoE]
    moe = model.model.layers[1].mlp
    assert moe.routing.correction_bias and moe.routing.renormalize and moe.shared_expert is not None
    assert torch.equal(moe.gate.e_score_correction_bias,
                       hf.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.reshape(-1))
    assert (model.lm_head_bias is not None) == use_bias
    assert model.model.layers[0].self_attn.rope_interleaved
    check_hf(hf, model, prompts(VOCAB))


def test_ernie4_5_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "ernie4_5-moe" GGUF (the layout keys as expert_* / leading_dense_block_count /
    interleave_moe_layer_step, the selection bias as exp_probs_b, the LM head's bias as
    output.bias beside the tied embedding) equals the HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(ernie_config(), prepare=_randomize_selection_bias)
    check_gguf_family("ernie4_5_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
