"""Our Jamba (Mamba 1 layers with dt / B / C norms whose state lives in paged cache entries,
NoPE attention layers, MoE every other layer with unrenormalized softmax top-k) equals HF
transformers in float32; chunking and batching are bit-exact; a bf16 cache binds and runs."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.layers.mamba1 import Mamba1Mixer
from pagedserve.layers.moe import FusedMoE
from pagedserve.models.jamba import JambaForCausalLM

VOCAB = 300


def jamba_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.JambaConfig(**kwargs)


def randomize_mamba(hf):
    """A_log, D and dt_proj's bias away from the generic randomizer's small draws."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            if getattr(layer, "mamba", None) is not None:
                m = layer.mamba
                m.A_log.copy_(torch.rand(m.A_log.shape, generator=gen) * 2 - 1)
                m.D.copy_(torch.randn(m.D.shape, generator=gen))
                m.dt_proj.bias.copy_(torch.randn(m.dt_proj.bias.shape, generator=gen))


CASES = {
    "jamba": {},
    # experts on the attention layers, a bias on the projections, no conv bias, auto dt_rank
    "biases-experts-on-attention": {"expert_layer_offset": 1, "mamba_proj_bias": True,
                                    "mamba_conv_bias": False, "mamba_dt_rank": "auto"},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_jamba_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(jamba_config(**overrides), prepare=randomize_mamba)
    assert isinstance(model, JambaForCausalLM)
    layers = model.model.layers
    assert [layer.has_attention for layer in layers] == [False, True, False, True]
    moe = [isinstance(layer.mlp, FusedMoE) for layer in layers]
    assert moe == ([True, False] * 2 if not overrides else [False, True] * 2)
    assert all(isinstance(layers[i].mamba, Mamba1Mixer) for i in (0, 2))
    per_mamba = layers[0].mamba.num_entries
    specs = model.kv_cache_spec.layer_specs()
    assert len(specs) == 2 + 2 * per_mamba
    assert specs[0] == RecurrentStateSpec(2, 16)
    assert specs[per_mamba] == FullAttentionSpec(2, 16)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@torch.inference_mode()
def test_jamba_chunking_and_batching_are_bit_exact(hf_pair, paged_runner, prompts):
    _, model, _ = hf_pair(jamba_config(), prepare=randomize_mamba)
    first, other = prompts(VOCAB, lengths=(15, 6))
    whole = torch.cat(paged_runner(model).step([(0, first)]))
    runner = paged_runner(model, seed=2)
    chunks = [runner.step([(0, first[a:b])])[0] for a, b in ((0, 6), (6, 7), (7, 15))]
    assert torch.equal(torch.cat(chunks), whole)
    runner = paged_runner(model, seed=3)
    singles = [runner.step([(0, [tok])])[0] for tok in first]
    assert torch.equal(torch.cat(singles), whole)
    # batched with another sequence (chunk by chunk): each sequence's rows as alone
    runner = paged_runner(model, seed=4)
    a1, b1 = runner.step([(0, first[:9]), (1, other[:2])])
    a2, b2 = runner.step([(0, first[9:]), (1, other[2:])])
    assert torch.equal(torch.cat([a1, a2]), whole)
    assert torch.equal(torch.cat([b1, b2]), torch.cat(paged_runner(model).step([(0, other)])))


def test_jamba_state_entries_follow_block_size_and_dtype_and_a_bf16_cache_runs(hf_pair, paged_runner,
                                                                              prompts):
    """The state is float32 bytes in entries of the cache's dtype (twice as many in bf16)."""
    _, model, _ = hf_pair(jamba_config(), prepare=randomize_mamba)
    mixer = model.model.layers[0].mamba
    floats = 3 * 128 + 128 * 8  # conv rows, SSM state
    assert mixer.num_entries == -(-floats * 4 // (16 * 64 * 4))  # defaults: 16 tokens, float32
    model.bind_cache(4, torch.bfloat16)
    assert mixer.num_entries == -(-floats * 4 // (4 * 64 * 2))
    assert model.kv_cache_spec.num_layers == 2 + 2 * mixer.num_entries
    assert model.model.cache_entries_of[1] == [mixer.num_entries]
    prompt = prompts(VOCAB, lengths=(9,))[0]
    ref = paged_runner(model).step([(0, prompt)])[0]
    runner = paged_runner(model, kv_dtype=torch.bfloat16)
    out = torch.cat([runner.step([(0, prompt[:4])])[0], runner.step([(0, prompt[4:])])[0]])
    assert torch.isfinite(out).all()
    # only the attention layers' K / V are rounded to bf16
    assert (out - ref).abs().max() < 0.5


def test_jamba_rejects_bad_periods_and_indivisible_channels():
    from pagedserve.distributed.tp import TPContext
    from pagedserve.models.jamba import jamba_attention_layers

    config = jamba_config()
    config.attn_layer_offset = 2
    with pytest.raises(ValueError, match="attn_layer_offset"):
        jamba_attention_layers(config)
    with pytest.raises(ValueError, match=r"mamba intermediate channels \(128\).*tensor_parallel_size \(3\)"):
        Mamba1Mixer(64, intermediate_size=128, state_size=8, dt_rank=8, conv_kernel=4, page=64,
                    tp=TPContext(rank=0, world_size=3))


def test_jamba_tensor_parallel_splits_the_mamba_channels():
    from pagedserve.distributed.tp import TPContext

    whole = JambaForCausalLM(jamba_config()).model.layers[0].mamba
    half = JambaForCausalLM(jamba_config(), tp=TPContext(rank=1, world_size=2)).model.layers[0].mamba
    assert half.inter == 64 and half.A_log.shape == (64, 8) and half.conv1d.weight.shape == (64, 1, 4)
    assert half.x_proj.weight.shape == (24, 64) and half.dt_proj.weight.shape == (64, 8)
    assert half.A_log.shard.ranges == ((64, 128),) and half.in_proj.weight.shard.ranges == ((64, 128), (192, 256))
    assert half.state.numel * 2 == whole.state.numel


def test_jamba_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "jamba" (no period keys: the attention layers from the per-layer KV heads,
    the MoE layers from the routers; A as -exp(A_log) `[I, N]`): equal to the HF folder; Q8_0
    projections kept as blocks give HF's greedy tokens."""
    from mamba_gguf import check_mamba_gguf, write_jamba_gguf

    hf, _, folder = hf_pair(jamba_config(), prepare=randomize_mamba)
    model = check_mamba_gguf(write_jamba_gguf, hf, folder, tmp_path, prompts(VOCAB), check_hf)
    config = model.config
    assert (config.attn_layer_period, config.attn_layer_offset) == (2, 1)
    assert (config.expert_layer_period, config.expert_layer_offset) == (2, 0)
