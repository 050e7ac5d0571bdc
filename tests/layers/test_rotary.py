"""Our RoPE frequencies and rotation equal transformers' for every rope scaling HF configs carry
(exactly, float32 and bf16), in both layouts, over whole and partial heads."""

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.glm4 import modeling_glm4
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3 import modeling_phi3

from pagedserve.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    compute_inv_freq,
    norm_and_rotate,
    rope_parameters,
    yarn_softmax_scale,
)

SHORT = [1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0] * 2  # 16 = head_dim 32 / 2
LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0] * 2
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
    "yarn_mscale": {  # DeepSeek V2 / V3
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },
    "yarn_untruncated": {  # gpt-oss
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 0.75,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 32,
    },
    "longrope_factors": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 32,
        "factor": 3.0,
        "attention_factor": 1.25,
    },
}


def make_config(rope, partial: float = 1.0):
    """A config with max_position_embeddings 128 and head_dim 32 (Phi-3's: longrope's own)."""
    rope = dict(rope)
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
        n = int(32 * partial) // 2
        for key in ("short_factor", "long_factor"):
            if key in rope:
                rope[key] = rope[key][:n]
    if rope["rope_type"] == "longrope":  # Phi-3's own attribute overrides the dict's
        return transformers.Phi3Config(hidden_size=64, num_attention_heads=2, max_position_embeddings=128,
                                       original_max_position_embeddings=32, rope_parameters=rope)
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=128,
                                    rope_parameters=rope)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_matches_transformers(name, partial):
    config = make_config(ROPES[name], partial)
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    for seq_len in (None, 33, 300):
        if rope_type == "default":
            ref, ref_scale = modeling_phi3.Phi3RotaryEmbedding.compute_default_rope_parameters(config)
        else:
            ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
        ours, scale = compute_inv_freq(params, 32, config.max_position_embeddings, seq_len=seq_len)
        assert ours.shape == (int(32 * partial) // 2,)
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
        assert scale == ref_scale


def _hf_cos_sin(hf_rope, positions, dtype):
    """HF's rotary class run as in a forward over one sequence: cos/sin [T, R] for `positions`."""
    x = torch.zeros(1, dtype=dtype)
    cos, sin = hf_rope(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn_mscale", "yarn_untruncated", "longrope"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rotation_matches_transformers(name, partial, dtype):
    """A step's q/k rotate bit for bit as under HF's rotary class + `apply_rotary_pos_emb`
    (longrope: the short factors within the original context when the served context stays
    there, the long ones for a sequence past it)."""
    config = make_config(ROPES[name], partial)
    hf_rope = modeling_phi3.Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(32, rope_parameters(config), config.max_position_embeddings)
    steps = [(torch.tensor([0, 1, 2, 7, 20, 31, 3]), 32)]
    if name == "longrope":
        steps.append((torch.tensor([0, 1, 2, 7, 20, 31, 3, 40]), 128))
    gen = torch.Generator().manual_seed(0)
    for positions, max_model_len in steps:
        ours.set_max_model_len(max_model_len)
        q = torch.randn(len(positions), 2, 32, generator=gen).to(dtype)  # [T, H, D]
        k = torch.randn(len(positions), 1, 32, generator=gen).to(dtype)
        cos, sin = _hf_cos_sin(hf_rope, positions, dtype)
        ref_q, ref_k = modeling_phi3.apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None], unsqueeze_dim=2)
        our_cos, our_sin = ours(positions, dtype)
        assert torch.equal(our_cos, cos) and torch.equal(our_sin, sin)
        our_q, our_k = apply_rotary(q, k, our_cos, our_sin)
        assert torch.equal(our_q, ref_q[0]) and torch.equal(our_k, ref_k[0])


def test_longrope_factors_chosen_by_the_served_context():
    """One set for every token: the long factors when the served context exceeds the original
    one (by default: max_position_embeddings 128 > 32), else the short."""
    config = make_config(ROPES["longrope"])
    ours = RotaryEmbedding(32, rope_parameters(config), config.max_position_embeddings)
    assert ours.uses_long_factors
    long, _ = ours(torch.tensor([5, 40]), torch.float32)
    assert torch.equal(long[0], ours(torch.tensor([5]), torch.float32)[0][0])  # per token
    ours.set_max_model_len(32)
    assert not ours.uses_long_factors
    short, _ = ours(torch.tensor([5]), torch.float32)
    assert not torch.equal(short[0], long[0])
    hf_rope = modeling_phi3.Phi3RotaryEmbedding(config)
    assert torch.equal(short[0], _hf_cos_sin(hf_rope, torch.tensor([5]), torch.float32)[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phimoe_mscales_match_transformers(dtype):
    """Phi-3.5-MoE's LongRoPE: cos/sin times `short_mscale` when served within the original
    context, `long_mscale` with the long factors past it, bit for bit as HF's rotary. (HF 5.x's
    keeps the short factors past it, layers/rotary.py's NOTE: its reference for that side is
    built with the long factors as its short ones.)"""
    from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

    rope = {**ROPES["longrope"], "short_mscale": 1.3, "long_mscale": 0.8}

    def config(short):
        return transformers.PhimoeConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=128,
                                         rope_parameters={**rope, "short_factor": short})

    ours = RotaryEmbedding(32, rope_parameters(config(SHORT)), 128)
    for served, positions, hf_short, scale in ((32, [0, 1, 7, 31, 3], SHORT, 1.3),
                                               (128, [0, 1, 7, 31, 40, 3], LONG, 0.8)):
        ours.set_max_model_len(served)
        assert ours.attention_scaling == scale
        cos, sin = _hf_cos_sin(PhimoeRotaryEmbedding(config(hf_short)), torch.tensor(positions), dtype)
        our_cos, our_sin = ours(torch.tensor(positions), dtype)
        assert torch.equal(our_cos, cos) and torch.equal(our_sin, sin)


def test_dynamic_matches_transformers_per_position():
    config = make_config(ROPES["dynamic"])
    ours = RotaryEmbedding(32, rope_parameters(config), config.max_position_embeddings)
    for position in (5, 127, 200):  # the last one past max_position_embeddings: a grown base
        hf_rope = LlamaRotaryEmbedding(config)
        cos, sin = _hf_cos_sin(hf_rope, torch.tensor([position]), torch.float32)
        our_cos, our_sin = ours(torch.tensor([position]), torch.float32)
        assert torch.equal(our_cos, cos) and torch.equal(our_sin, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_partial_matches_glm4(dtype):
    config = transformers.Glm4Config(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=64)
    params = rope_parameters(config)
    assert params["partial_rotary_factor"] == 0.5
    hf_rope = modeling_glm4.Glm4RotaryEmbedding(config)
    ours = RotaryEmbedding(32, params, config.max_position_embeddings, interleaved=True)
    positions = torch.tensor([0, 1, 5, 63, 2])
    q = torch.randn(len(positions), 2, 32).to(dtype)
    k = torch.randn(len(positions), 1, 32).to(dtype)
    cos, sin = _hf_cos_sin(hf_rope, positions, dtype)
    ref_q, ref_k = modeling_glm4.apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None], unsqueeze_dim=2)
    our_q, our_k = norm_and_rotate(q.clone(), k.clone(), *ours(positions, dtype), interleaved=True)
    assert torch.equal(our_q, ref_q[0]) and torch.equal(our_k, ref_k[0])


def test_yarn_softmax_scale_matches_deepseek():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for name in ("yarn_mscale", "yarn", "default"):
        params = dict(ROPES[name])
        assert yarn_softmax_scale(params, 0.125) == yarn_apply_mscale(params, 0.125)


def test_rope_parameters_reads_transformers4_attributes():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}
    assert rope_parameters(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == {
        "rope_theta": 1e4,
        "rope_type": "default",
    }
    nested = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    assert rope_parameters(nested, "full_attention")["rope_theta"] == 1e6
    # Phi-3 style: partial_rotary_factor and original_max_position_embeddings as attributes
    phi = SimpleNamespace(rope_theta=1e4, partial_rotary_factor=0.75, max_position_embeddings=128,
                          original_max_position_embeddings=32,
                          rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]})
    params = rope_parameters(phi)
    assert params["partial_rotary_factor"] == 0.75 and params["original_max_position_embeddings"] == 32
    yarn = SimpleNamespace(max_position_embeddings=4096, rope_scaling={"type": "yarn", "factor": 4.0})
    assert rope_parameters(yarn)["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize(
    "params, named",
    [
        ({"rope_type": "longrope2", "rope_theta": 1e4}, "longrope2"),
        ({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 8, 16]}, "mrope_section"),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "llama_4_scaling_beta": 0.1}, "llama_4_scaling_beta"),
        ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 32, "long_factor": [1.0] * 32,
          "short_mscale": 1.1}, "long_mscale"),  # Phi-3.5-MoE's mscales come in pairs
        ({"rope_type": "linear", "rope_theta": 1e4}, "factor"),
    ],
)
def test_unsupported_rope_type_or_option_is_named(params, named):
    with pytest.raises(ValueError, match=named):
        compute_inv_freq(params, 64, 128)
