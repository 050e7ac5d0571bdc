"""Our Falcon-H1 (a Mamba2 mixer and attention side by side in every layer, muP multipliers
everywhere) equals HF transformers in float32; chunking is bit-exact."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.models.falcon_h1 import FalconH1ForCausalLM

VOCAB = 300


def falcon_h1_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        mamba_d_ssm=96, mamba_n_heads=6, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=4, mamba_rms_norm=True, mamba_norm_before_gate=False,
        embedding_multiplier=1.5, lm_head_multiplier=0.7, mlp_multipliers=[0.8, 1.3],
        key_multiplier=0.6, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
        ssm_in_multiplier=1.1, ssm_out_multiplier=0.8, ssm_multipliers=[0.9, 1.2, 0.7, 1.4, 0.5],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.FalconH1Config(**kwargs)


def randomize_mamba(hf):
    """A_log, D and dt_bias away from HF's init (the generic randomizer draws them small)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            m = layer.mamba
            m.A_log.copy_(torch.rand(m.A_log.shape, generator=gen) * 2 - 1)
            m.D.copy_(torch.randn(m.D.shape, generator=gen))
            m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen))


CASES = {
    "gated-norm": {},
    "norm-before-gate-biases": {"mamba_norm_before_gate": True, "projectors_bias": True,
                                "mamba_proj_bias": True, "attention_bias": True, "mlp_bias": True},
    "no-norm-one-group": {"mamba_rms_norm": False, "mamba_n_groups": 1},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_falcon_h1_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(falcon_h1_config(**overrides), prepare=randomize_mamba)
    assert isinstance(model, FalconH1ForCausalLM)
    specs = model.kv_cache_spec.layer_specs()
    per_mamba = model.model.layers[0].mamba.num_entries
    # each layer: its attention's entry, then its mixer's state
    assert len(specs) == 2 * (1 + per_mamba)
    assert specs[0] == FullAttentionSpec(2, 16) and specs[1] == RecurrentStateSpec(2, 16)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@torch.inference_mode()
def test_falcon_h1_chunking_is_bit_exact(hf_pair, paged_runner, prompts):
    _, model, _ = hf_pair(falcon_h1_config(), prepare=randomize_mamba)
    (prompt,) = prompts(VOCAB, lengths=(14,))
    whole = torch.cat(paged_runner(model).step([(0, prompt)]))
    runner = paged_runner(model, seed=2)
    chunks = [runner.step([(0, prompt[a:b])])[0] for a, b in ((0, 5), (5, 6), (6, 14))]
    assert torch.equal(torch.cat(chunks), whole)


def test_falcon_h1_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "falcon-h1" GGUF (every muP multiplier folded into the weights, the pre-MLP
    norm without a leaf, SSM tensors reshaped) equals the HF folder; Q8_0 projections kept as
    blocks give HF's greedy tokens."""
    from mamba_gguf import check_mamba_gguf, write_falcon_h1_gguf

    hf, _, folder = hf_pair(falcon_h1_config(tie_word_embeddings=False), prepare=randomize_mamba)
    model = check_mamba_gguf(write_falcon_h1_gguf, hf, folder, tmp_path, prompts(VOCAB), check_hf)
    assert model.model.embedding_multiplier == 1.0 and model.logit_scale == 1.0  # (folded)
