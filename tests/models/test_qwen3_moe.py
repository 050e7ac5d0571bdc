"""Our Qwen3-MoE (per-head q/k norm, wide heads, renormalized top-k, dense layers off the
`decoder_sparse_step` pattern) equals HF transformers in float32."""

import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.qwen3_moe import Qwen3MoeForCausalLM

VOCAB = 300


def qwen3_moe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.Qwen3MoeConfig(**kwargs)


def test_qwen3_moe_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(qwen3_moe_config())
    assert isinstance(model, Qwen3MoeForCausalLM)
    # decoder_sparse_step=2: experts in layer 1 only ((i + 1) % 2 == 0)
    assert [type(layer.mlp) for layer in model.model.layers] == [LlamaMLP, FusedMoE]
    assert model.kv_cache_spec.head_dim == 32
    check_hf(hf, model, prompts(VOCAB))


def test_qwen3_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    from moe_gguf import check_gguf_family

    # llama.cpp's qwen3moe has experts in every layer and renormalizes the top-k
    hf, _, folder = hf_pair(qwen3_moe_config(decoder_sparse_step=1))
    check_gguf_family("qwen3_moe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
