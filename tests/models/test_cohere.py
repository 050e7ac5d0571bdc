"""Our Cohere Command-R (parallel block, Cohere's LayerNorm, interleaved RoPE, optional per-head
q/k LayerNorms, logits times logit_scale, tied head) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec
from pagedserve.models.cohere import CohereForCausalLM
from pagedserve.models.loader import load_model

VOCAB = 300


def cohere_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.CohereConfig(**kwargs)


@pytest.mark.parametrize("qk_norm,bias,scale", [(False, False, 0.5), (True, True, 0.3)],
                         ids=["plain", "qk-norm-bias"])
def test_cohere_matches_hf(hf_pair, check_hf, prompts, qk_norm, bias, scale):
    hf, model, folder = hf_pair(cohere_config(use_qk_norm=qk_norm, attention_bias=bias, logit_scale=scale))
    assert isinstance(model, CohereForCausalLM)
    assert model.logit_scale == scale and model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert (attn.q_norm is not None) == qk_norm and (attn.o_proj.bias is not None) == bias
    if qk_norm:  # one weight row per head, as HF's
        assert attn.q_norm.weight.shape == (4, 16) and attn.k_norm.weight.shape == (2, 16)
    assert all(isinstance(s, FullAttentionSpec) for s in model.kv_cache_spec.layer_specs())
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_cohere_greedy_fast_path_only_under_an_exact_logit_scale():
    """A power-of-two logit_scale (Command-R's 1/16) keeps every fp32 logit's order and ties: the
    LM head's fused argmax may choose greedy tokens; under another the logits decide."""
    for scale, exact in ((0.0625, True), (0.3, False)):
        model = load_model(cohere_config(logit_scale=scale), weights=None, dtype=torch.float32, seed=0)
        hidden = torch.randn(3, 64)
        logits = model.compute_logits(hidden)  # [3, V]
        assert torch.equal(logits, model.lm_head(hidden).float() * scale)
        calls = []
        model.lm_head.greedy = lambda x: calls.append(x) or torch.zeros(x.shape[0], dtype=torch.long)
        model.greedy_tokens(hidden)
        assert bool(calls) == exact


def test_cohere_partial_rotary_factor_is_a_value_error():
    config = cohere_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_model(config, weights=None, dtype=torch.float32)


def test_command_r_q8_0_gguf_keeps_its_per_head_norms_in_float(hf_pair, tmp_path):
    """llama.cpp's "command-r" as Q8_0 (the converter keeps norms unquantized): the q/k norms
    load as `[heads, head_dim]` floats, the projections as blocks, and the quantized bf16 model's
    greedy token is in the HF model's top 5 at every position."""
    import gguf
    from test_gguf_dense_families import _load, assert_greedy_in_hf_top5, write_family_gguf

    hf, _, _ = hf_pair(cohere_config(use_qk_norm=True, logit_scale=0.0625))
    path = write_family_gguf(tmp_path / "command-r-q8.gguf", "command-r", hf, gguf.GGMLQuantizationType.Q8_0)
    config, model = _load(path, tmp_path, keep_quantized=True)
    assert config.use_qk_norm and config.logit_scale == 0.0625 and config.layer_norm_eps == 1e-5
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.uint8 and attn.q_norm.weight.shape == (4, 16)
    assert torch.equal(attn.q_norm.weight.float(), hf.model.layers[0].self_attn.q_norm.weight.bfloat16().float())
    assert_greedy_in_hf_top5(hf, model)
