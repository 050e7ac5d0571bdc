"""Our DeepSeek V2 / V3 (multi-head latent attention over a paged latent cache) equals HF."""

import pytest
import transformers

from pagedserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

VOCAB = 300


def _mla(**over):
    """A tiny MLA shape: latent 48 + rope 16 = one 64-wide cache row per token."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=48, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
                tie_word_embeddings=False)
    base.update(over)
    return base


def test_deepseek_v2_lite_dense_mla(hf_pair, check_hf, prompts):
    """V2-Lite's attention (no q_lora_rank), every layer dense: MLA alone."""
    config = transformers.DeepseekV2Config(**_mla(q_lora_rank=None, first_k_dense_replace=2,
                                                  n_routed_experts=4, moe_intermediate_size=16))
    hf, model, _ = hf_pair(config)
    assert isinstance(model, DeepseekV2ForCausalLM)
    assert (model.kv_cache_spec.num_kv_heads, model.kv_cache_spec.head_dim) == (1, 64)
    check_hf(hf, model, prompts(VOCAB))


def test_deepseek_v3_dense_mla_q_lora_yarn(hf_pair, check_hf, prompts):
    """V3's attention with q_lora_rank, YaRN (mscale / mscale_all_dim: the softmax scale and the
    rope's attention factor), every layer dense."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 1.0}
    config = transformers.DeepseekV3Config(**_mla(q_lora_rank=32, first_k_dense_replace=2,
                                                  n_routed_experts=4, moe_intermediate_size=16,
                                                  n_group=2, topk_group=1, rope_parameters=rope))
    hf, model, _ = hf_pair(config)
    assert isinstance(model, DeepseekV3ForCausalLM)
    attn = model.model.layers[0].self_attn
    assert attn.scale != (16 + 16) ** -0.5  # the mscale applies
    check_hf(hf, model, prompts(VOCAB))
