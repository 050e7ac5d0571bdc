"""Our OLMoE (q/k RMSNorm over the whole projections, clip_qkv, softmax top-k experts) equals
HF transformers in float32."""

import transformers

from pagedserve.models.olmoe import OlmoeForCausalLM

VOCAB = 300


def olmoe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, clip_qkv=1.5, max_position_embeddings=128, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.OlmoeConfig(**kwargs)


def test_olmoe_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(olmoe_config())
    assert isinstance(model, OlmoeForCausalLM)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    check_hf(hf, model, prompts(VOCAB))


def test_olmoe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(olmoe_config())
    check_gguf_family("olmoe", hf, folder, tmp_path, prompts(VOCAB), check_hf)
