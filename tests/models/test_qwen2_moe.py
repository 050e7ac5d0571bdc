"""Our Qwen2-MoE (q/k/v bias, experts + a shared expert behind a sigmoid gate, dense layers from
`mlp_only_layers` / `decoder_sparse_step`) equals HF transformers in float32."""

import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.qwen2_moe import Qwen2MoeForCausalLM

VOCAB = 300


def qwen2_moe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.Qwen2MoeConfig(**kwargs)


def test_qwen2_moe_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(qwen2_moe_config())
    assert isinstance(model, Qwen2MoeForCausalLM)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [FusedMoE, LlamaMLP, FusedMoE]  # layer 1 dense (mlp_only_layers)
    moe = model.model.layers[0].mlp
    assert moe.shared_expert_gate.weight.shape == (1, 64) and moe.shared_expert is not None
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    check_hf(hf, model, prompts(VOCAB))


def test_qwen2_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    from moe_gguf import check_gguf_family

    # llama.cpp's qwen2moe has experts in every layer
    hf, _, folder = hf_pair(qwen2_moe_config(mlp_only_layers=[], num_hidden_layers=2))
    check_gguf_family("qwen2_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
