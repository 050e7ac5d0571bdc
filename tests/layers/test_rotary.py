"""Our RoPE frequencies and rotation equal transformers' for every supported rope type."""

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq, rope_parameters

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },
}


def llama_config(rope):
    return transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=128, rope_parameters=dict(rope)
    )


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_matches_transformers(name):
    config = llama_config(ROPES[name])
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        ref, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
    ours, scale = compute_inv_freq(params, 64, config.max_position_embeddings)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale)
    if name == "dynamic":
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=300)
        ours, _ = compute_inv_freq(params, 64, config.max_position_embeddings, seq_len=300)
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["default", "llama3", "yarn_mscale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_transformers(name, dtype):
    config = llama_config(ROPES[name])
    hf_rope = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(64, rope_parameters(config), config.max_position_embeddings)
    positions = torch.tensor([0, 1, 2, 7, 100, 127, 3])
    q = torch.randn(len(positions), 2, 64).to(dtype)  # [T, H, D]
    k = torch.randn(len(positions), 1, 64).to(dtype)
    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    our_q, our_k = apply_rotary(q, k, *ours(positions, dtype))
    assert torch.equal(our_q, ref_q[0]) and torch.equal(our_k, ref_k[0])


def test_rope_parameters_reads_transformers4_attributes():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}
    assert rope_parameters(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == {
        "rope_theta": 1e4,
        "rope_type": "default",
    }
    nested = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    assert rope_parameters(nested, "full_attention")["rope_theta"] == 1e6


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="longrope"):
        compute_inv_freq({"rope_type": "longrope", "rope_theta": 1e4}, 64, 128)
