"""Our Granite MoE (Granite's multipliers, a router weighing the softmax of its top-k logits,
experts stacked as input_linear / output_linear) and Granite MoE Shared (plus a shared MLP)
equal HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.granite_moe import GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM

VOCAB = 300


def granite_moe_config(shared: int = 0, **overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    if shared:
        return transformers.GraniteMoeSharedConfig(shared_intermediate_size=shared, **kwargs)
    return transformers.GraniteMoeConfig(**kwargs)


@pytest.mark.parametrize("shared", [0, 48], ids=["granitemoe", "granitemoeshared"])
def test_granite_moe_matches_hf(hf_pair, check_hf, prompts, shared):
    hf, model, _ = hf_pair(granite_moe_config(shared))
    assert type(model) is (GraniteMoeSharedForCausalLM if shared else GraniteMoeForCausalLM)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, FusedMoE) and layer.mlp.routing.scoring == "softmax_topk"
    assert (layer.mlp.shared_expert is not None) == bool(shared)
    assert layer.self_attn.attn.scale == 0.2 and not layer.fusable_attention
    # the fused input_linear split at load: expert 3's gate rows, then its up rows
    fused = hf.model.layers[0].block_sparse_moe.experts.gate_up_proj[3]  # [2I, H]
    assert torch.equal(layer.mlp.experts.gate_proj[3].float(), fused[:32].float())
    assert torch.equal(layer.mlp.experts.up_proj[3].float(), fused[32:].float())
    check_hf(hf, model, prompts(VOCAB))


def test_granite_moe_without_multipliers_runs_the_fused_attention_half(hf_pair, check_hf, prompts):
    """With residual_multiplier 1 the layer is Mixtral's (its decode attention half may fuse);
    the outputs still equal HF's."""
    hf, model, _ = hf_pair(granite_moe_config(residual_multiplier=1.0))
    assert model.model.layers[0].fusable_attention
    check_hf(hf, model, prompts(VOCAB))


@pytest.mark.parametrize("shared", [0, 48], ids=["granitemoe", "granitemoeshared"])
def test_granite_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, shared):
    """llama.cpp's "granitemoe" GGUF (experts split into ffn_{gate,up}_exps, Q/K rows permuted,
    the multipliers as scales; the shared MLP as ffn_*_shexp) equals the HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(granite_moe_config(shared))
    check_gguf_family("granitemoe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
