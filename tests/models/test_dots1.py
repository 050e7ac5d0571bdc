"""Our dots.llm1 (Qwen3's attention with its biases and windows, DeepSeek-V3's MoE after dense
first layers) equals HF transformers in float32."""

import pytest
import transformers
from test_glm4_moe import _randomize_correction_bias  # (the same DeepSeek-V3 router)

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.dots1 import Dots1ForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def dots1_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=128, sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Dots1Config(**kwargs)


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "norm_topk_prob": False},
                                       {"sliding_window": 4, "max_window_layers": 1}],
                         ids=["plain", "biases", "windows"])
def test_dots1_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(dots1_config(**overrides), prepare=_randomize_correction_bias)
    assert isinstance(model, Dots1ForCausalLM)
    assert [type(layer.mlp) for layer in model.model.layers] == [LlamaMLP, FusedMoE, FusedMoE]
    attn = model.model.layers[1].self_attn
    assert attn.q_norm is not None and (attn.o_proj.bias is not None) == bool(overrides.get("attention_bias"))
    want = [None, 4, 4] if overrides.get("sliding_window") else [None] * 3
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == want
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
