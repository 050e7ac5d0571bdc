"""Our AfMoE (Arcee Trinity: gated attention with q/k norms, sliding RoPE layers and global NoPE
ones, sandwich norms, muP embedding scale, a dense first layer, sigmoid experts chosen with a
selection bias, renormalized and scaled, beside shared experts) equals HF transformers in
float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.afmoe import AfmoeForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def afmoe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5,
        global_attn_every_n_layers=2, sliding_window=4, mup_enabled=True, route_norm=True,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    kwargs.update(overrides)
    return transformers.AfmoeConfig(**kwargs)


def _expert_bias(hf):
    """Selection biases that move the choice (HF's init is zeros; `randomize_` draws them small)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.expert_bias.copy_(torch.rand(8, generator=gen) * 0.5)


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mup_enabled": False, "num_shared_experts": 2}],
                         ids=["trinity", "biases-no-mup-two-shared"])
def test_afmoe_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(afmoe_config(**overrides), prepare=_expert_bias)
    assert isinstance(model, AfmoeForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, FusedMoE, FusedMoE, FusedMoE]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4, None, 4, None]
    assert model.model.use_rope == [True, False, True, False]  # the global layers: NoPE
    moe = layers[1].mlp
    assert moe.routing.scoring == "sigmoid" and moe.routing.renormalize and moe.routing.routed_scaling_factor == 2.5
    assert torch.equal(moe.gate.e_score_correction_bias, hf.model.layers[1].mlp.expert_bias)
    assert moe.shared_expert.gate_proj.weight.shape[0] == 32 * overrides.get("num_shared_experts", 1)
    assert (layers[0].self_attn.o_proj.bias is not None) == bool(overrides.get("attention_bias"))
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_afmoe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "afmoe" GGUF (the attention gate as attn_gate, the sandwich norms as
    post_attention_norm / ffn_norm / post_ffw_norm, the selection bias as exp_probs_b, the layer
    pattern from the window, muP always on) equals the HF folder."""
    from moe_gguf import check_gguf_family

    config = afmoe_config(global_attn_every_n_layers=4, num_hidden_layers=4)
    hf, _, folder = hf_pair(config, prepare=_expert_bias)
    check_gguf_family("afmoe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
