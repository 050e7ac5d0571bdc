"""Our HunYuan dense and MoE (q/k RMSNorms per head *after* RoPE, the checkpoints' fixed NTK-alpha
RoPE, softmax top-k experts beside a shared MLP) equal HF transformers in float32."""

import pytest
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM

VOCAB = 300
# as the checkpoints' config.json: "dynamic" with an alpha (HF: fixed NTK-alpha, no dynamic part)
ALPHA_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}


def hunyuan_config(moe: bool, **overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  rope_parameters=dict(ALPHA_ROPE), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if moe:
        kwargs.update(num_experts=8, moe_topk=2)
    kwargs.update(overrides)
    cls = transformers.HunYuanMoEV1Config if moe else transformers.HunYuanDenseV1Config
    return cls(**kwargs)


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "tie_word_embeddings": True,
                                            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}],
                         ids=["alpha-rope", "biases-tied-default-rope"])
def test_hunyuan_dense_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(hunyuan_config(False, **overrides))
    assert isinstance(model, HunYuanDenseV1ForCausalLM)
    attn = model.model.layers[0].self_attn
    assert attn.query_layernorm is not None and attn.q_norm is None  # (ours: after RoPE)
    assert (attn.o_proj.bias is not None) == bool(overrides.get("attention_bias"))
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 30)))


def test_hunyuan_moe_matches_hf(hf_pair, check_hf, prompts):
    """Hunyuan-A13B's per-layer lists (`moe_topk` as its config.json gives it) read as one value."""
    hf, model, _ = hf_pair(hunyuan_config(True),
                           edit_config=lambda c: {**c, "moe_topk": [2, 2], "num_shared_expert": [1, 1]})
    assert isinstance(model, HunYuanMoEV1ForCausalLM)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, FusedMoE) and moe.routing.top_k == 2 and moe.shared_expert is not None
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 30)))


def test_hunyuan_alpha_rope_base_and_refusals():
    from pagedserve.models.hunyuan import hunyuan_rope_parameters

    params = hunyuan_rope_parameters(hunyuan_config(False))
    assert params["rope_type"] == "default"
    assert params["rope_theta"] == pytest.approx(10000.0 * 1000.0 ** (16 / 14))
    with pytest.raises(ValueError, match="use_cla"):
        HunYuanDenseV1ForCausalLM(hunyuan_config(False, use_cla=True))
    with pytest.raises(ValueError, match="moe_topk"):
        HunYuanMoEV1ForCausalLM(hunyuan_config(True, moe_topk=[2, 1]))


def test_hunyuan_moe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "hunyuan-moe" GGUF (the NTK-alpha base as rope.freq_base, q/k norms as
    attn_q_norm / attn_k_norm, the router as ffn_gate_inp, the shared MLP as *_shexp) equals the
    HF folder."""
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(hunyuan_config(True))
    check_gguf_family("hunyuan_v1_moe", hf, folder, tmp_path, prompts(VOCAB, lengths=(13, 5, 30)), check_hf)
