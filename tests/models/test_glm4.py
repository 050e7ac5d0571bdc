"""Our GLM-4 and GLM (interleaved partial RoPE, fused gate_up, GLM-4's extra post-norms) equal HF
transformers."""

import pytest
import transformers

from pagedserve.models.glm4 import Glm4ForCausalLM, GlmForCausalLM

VOCAB = 300


@pytest.mark.parametrize("config_class,model_class", [(transformers.Glm4Config, Glm4ForCausalLM),
                                                      (transformers.GlmConfig, GlmForCausalLM)])
def test_glm_matches_hf(hf_pair, check_hf, prompts, config_class, model_class):
    config = config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, model_class)
    rope = model.model.rotary_emb
    assert rope.rotary_dim == 8 and rope.interleaved
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    check_hf(hf, model, prompts(VOCAB))
