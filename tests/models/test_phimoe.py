"""Our Phi-3.5-MoE (LayerNorms with biases, q/k/v/o and LM head biases, sparsemixer routing,
LongRoPE with its short / long mscale) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import MoERouting, select_experts
from pagedserve.models.phimoe import PhimoeForCausalLM

VOCAB = 300
# LongRoPE from 32 to 64 positions; the mscales differ from each other and from the attention
# factor HF would compute without them (sqrt(1 + ln 2 / ln 32) = 1.095)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            "short_mscale": 1.3, "long_mscale": 0.8}


def phimoe_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64, attention_bias=True, lm_head_bias=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.PhimoeConfig(**kwargs)


def _serve_short(model):
    """Serve the model within the original context (the short factors and mscale: HF's choice
    for sequences that short; see `layers.rotary.RotaryEmbedding`)."""
    model.model.rotary_emb.set_max_model_len(32)


@pytest.mark.parametrize("variant", ["longrope-biases", "default-rope-no-biases"])
def test_phimoe_matches_hf(hf_pair, check_hf, prompts, variant):
    rope = LONGROPE if variant == "longrope-biases" else {"rope_type": "default", "rope_theta": 10000.0}
    bias = variant == "longrope-biases"
    # a wide jitter band (HF's default, 0.01, with the other): near-ties share the weight
    jitter = 0.2 if bias else 0.01
    hf, model, _ = hf_pair(phimoe_config(rope_parameters=rope, attention_bias=bias, lm_head_bias=bias,
                                         router_jitter_noise=jitter))
    assert isinstance(model, PhimoeForCausalLM)
    layer = model.model.layers[0]
    assert isinstance(model.model.norm, torch.nn.LayerNorm) and model.model.norm.bias is not None
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm) and not layer.fusable_attention
    assert (layer.self_attn.o_proj.bias is not None) == bias
    assert (model.lm_head_bias is not None) == bias
    assert layer.mlp.routing.scoring == "sparsemixer" and layer.mlp.routing.jitter_eps == jitter
    if variant == "longrope-biases":
        _serve_short(model)
        assert model.model.rotary_emb.attention_scaling == 1.3
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 20)))


def test_phimoe_served_past_the_original_context_takes_the_long_mscale(hf_pair, check_hf, prompts):
    """Served to 64 > 32 positions, with sequences past 32: the long mscale (HF's choice for
    such sequences). HF 5.x keeps the short factors there (`layers.rotary`'s NOTE), so both
    sets are equal here: this checks the mscale, test_rotary the factors."""
    rope = {**LONGROPE, "short_factor": LONGROPE["long_factor"]}
    hf, model, _ = hf_pair(phimoe_config(rope_parameters=rope))
    assert model.model.rotary_emb.uses_long_factors and model.model.rotary_emb.attention_scaling == 0.8
    check_hf(hf, model, prompts(VOCAB, lengths=(40, 35)))


def test_sparsemixer_is_hfs_and_not_a_renormalized_softmax():
    """Our routing equals HF's `sparsemixer` (inference) on logits with near-ties and clear
    winners; its weights are not the top-2 softmax renormalized (Mixtral's)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen) * 2.0  # [T, E]
    logits[:8, 3] = logits[:8, 5] * 1.01  # near-ties inside the jitter band
    for eps in (0.01, 0.2):
        ref_w, ref_ids = sparsemixer(logits, jitter_eps=eps, training=False)
        w, ids = select_experts(logits, MoERouting(top_k=2, scoring="sparsemixer", jitter_eps=eps))
        assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    mixtral, _ = select_experts(logits, MoERouting(top_k=2, scoring="softmax", renormalize=True))
    assert not torch.allclose(w, mixtral, atol=1e-3)


def test_phimoe_config_we_do_not_implement_is_named():
    from pagedserve.models.loader import load_model

    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_model(phimoe_config(num_experts_per_tok=3), weights=None, dtype=torch.float32)
    rope = {k: v for k, v in LONGROPE.items() if k != "long_mscale"}
    config = phimoe_config()
    config.rope_parameters = rope  # (HF's config refuses it; an edited config.json may not)
    with pytest.raises(ValueError, match="long_mscale"):
        load_model(config, weights=None, dtype=torch.float32)


def test_phimoe_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "phimoe" GGUF (LayerNorm biases as attn_norm / ffn_norm / output_norm .bias,
    the LM head's as output.bias, LongRoPE as the rope_factors_long / _short tensors and the
    converter's rope.scaling.attn_factor), served within the original context, equals the HF
    folder. NOTE: the file keeps one attention factor, sqrt(1 + ln(64 / 32) / ln 32) as the
    converter computes it, not the mscales (nor router_jitter_noise: HF's default here): this
    checkpoint's mscales are that value."""
    import math

    from moe_gguf import check_gguf_family

    factor = math.sqrt(1 + math.log(2) / math.log(32))
    rope = {**LONGROPE, "short_mscale": factor, "long_mscale": factor}
    hf, _, folder = hf_pair(phimoe_config(rope_parameters=rope))
    check_gguf_family("phimoe", hf, folder, tmp_path, prompts(VOCAB), check_hf, max_model_len=32)


def test_phimoe_microsoft_style_config(hf_pair, check_hf, prompts):
    """A config.json as microsoft/Phi-3.5-MoE-instruct ships it (transformers 4 style:
    `PhiMoEForCausalLM`, `rope_scaling` with "type", `rope_theta` and the original context at the
    top level too) loads as Phi-3.5-MoE with its mscales."""
    from pagedserve.models.phimoe import PhiMoEForCausalLM

    def microsoft(cfg):
        rope = dict(cfg.pop("rope_parameters"))
        rope["type"] = rope.pop("rope_type")
        cfg["rope_theta"] = rope.pop("rope_theta")
        return {**cfg, "architectures": ["PhiMoEForCausalLM"], "rope_scaling": rope,
                "original_max_position_embeddings": rope["original_max_position_embeddings"]}

    hf, model, _ = hf_pair(phimoe_config(rope_parameters=LONGROPE), edit_config=microsoft)
    assert type(model) is PhiMoEForCausalLM
    _serve_short(model)
    assert model.model.rotary_emb.attention_scaling == 1.3
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 20)))
