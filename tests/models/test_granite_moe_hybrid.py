"""Our Granite 4.0-H (Mamba2 layers whose state lives in paged cache entries, Granite attention
layers with or without RoPE, Granite MoE + shared MLP, Granite's multipliers) equals HF
transformers in float32; its recurrent state gives the same bits however a prompt is chunked."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.layers.mamba2 import Mamba2Mixer
from pagedserve.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM

VOCAB = 300


def granite_hybrid_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=4, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.GraniteMoeHybridConfig(**kwargs)


def randomize_mamba(hf):
    """A_log, D and dt_bias away from HF's init (the generic randomizer draws them small)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.mamba is not None:
                m = layer.mamba
                m.A_log.copy_(torch.rand(m.A_log.shape, generator=gen) * 2 - 1)
                m.D.copy_(torch.randn(m.D.shape, generator=gen))
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen))


CASES = {
    "nope-moe": {},
    "rope-moe-bias": {"position_embedding_type": "rope", "attention_bias": True,
                      "mamba_conv_bias": False, "mamba_proj_bias": True},
    "dense-one-group": {"num_local_experts": 0, "mamba_n_groups": 1},
    "time-step-limit": {"time_step_limit": (0.05, 1.5)},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_granite_moe_hybrid_matches_hf(hf_pair, check_hf, prompts, overrides, scan_path):
    hf, model, _ = hf_pair(granite_hybrid_config(**overrides), prepare=randomize_mamba)
    assert isinstance(model, GraniteMoeHybridForCausalLM)
    assert isinstance(model.model.layers[0].mamba, Mamba2Mixer)
    specs = model.kv_cache_spec.layer_specs()
    # PagedRunner binds blocks of 4 tokens in float32: a state of 3 x 192 + 8 x 16 x 16 floats
    # in entries of 4 x 2 x 2 x 16 floats takes 11 entries
    per_mamba = model.model.layers[0].mamba.num_entries
    assert len(specs) == 1 + 3 * per_mamba
    assert specs[per_mamba] == FullAttentionSpec(2, 16)
    assert specs[0] == RecurrentStateSpec(2, 16)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_granite_moe_hybrid_state_entries_follow_block_size_and_dtype():
    model = GraniteMoeHybridForCausalLM(granite_hybrid_config())
    mixer = model.model.layers[0].mamba
    floats = 3 * mixer.conv_dim + 8 * 16 * 16  # conv rows, SSM state
    assert mixer.num_entries == -(-floats * 4 // (16 * 64 * 4))  # defaults: 16 tokens, float32
    model.bind_cache(4, torch.bfloat16)
    assert mixer.num_entries == -(-floats * 4 // (4 * 64 * 2))
    assert model.kv_cache_spec.num_layers == 1 + 3 * mixer.num_entries
    assert model.model.cache_entries_of[1] == [mixer.num_entries]


@pytest.fixture(params=["kernel", "torch"])
def scan_path(request, monkeypatch):
    """The SSM on the C++ kernel (where it builds) or on the torch loop."""
    if request.param == "torch":
        from pagedserve.platforms.cpu import CpuOps

        monkeypatch.setattr(CpuOps, "ssm_scan_paged", lambda *args: None)
    return request.param


@torch.inference_mode()
def test_granite_moe_hybrid_chunking_is_bit_exact(hf_pair, paged_runner, prompts, scan_path):
    """A prompt prefilled at once, in uneven chunks batched with another sequence, and token
    by token: the same logits, bit for bit (the recurrent state advances in one order)."""
    _, model, _ = hf_pair(granite_hybrid_config(position_embedding_type="rope"), prepare=randomize_mamba)
    prompt, other = prompts(VOCAB, lengths=(17, 11))
    whole = torch.cat(paged_runner(model).step([(0, prompt)]))

    runner = paged_runner(model, seed=3)
    got, fed, fed_other = [], 0, 0
    for n, m in ((5, 3), (1, 4), (7, 1), (4, 3)):
        batch = [(0, prompt[fed:fed + n])]
        if fed_other < len(other):
            batch.append((1, other[fed_other:fed_other + m]))
        outs = runner.step(batch)
        got.append(outs[0])
        fed, fed_other = fed + n, fed_other + m
    assert fed == len(prompt)
    assert torch.equal(torch.cat(got), whole)

    runner = paged_runner(model, seed=5)
    one_by_one = torch.cat([runner.step([(0, [tok])])[0] for tok in prompt])
    assert torch.equal(one_by_one, whole)


def test_granite_moe_hybrid_runs_on_a_bf16_cache(hf_pair, paged_runner, prompts):
    """The state is float32 bytes in entries of a bf16 cache (twice as many entries)."""
    hf, model, _ = hf_pair(granite_hybrid_config(), prepare=randomize_mamba)
    ref = paged_runner(model).step([(0, prompts(VOCAB, lengths=(9,))[0])])[0]
    f32_entries = model.model.layers[0].mamba.num_entries
    runner = paged_runner(model, kv_dtype=torch.bfloat16)
    assert model.model.layers[0].mamba.num_entries >= f32_entries
    prompt = prompts(VOCAB, lengths=(9,))[0]
    out = torch.cat([runner.step([(0, prompt[:4])])[0], runner.step([(0, prompt[4:])])[0]])
    assert torch.isfinite(out).all()
    # only the attention layer's K / V are rounded to bf16
    assert (out - ref).abs().max() < 0.5


def test_granite_moe_hybrid_rejects_unknown_layer_types():
    with pytest.raises(ValueError, match="layer_types"):
        GraniteMoeHybridForCausalLM(granite_hybrid_config(
            layer_types=["mamba", "conv", "mamba", "mamba"]))


def test_granite_moe_hybrid_tensor_parallel_splits_heads_and_groups_or_shares_a_group():
    """Ranks split the Mamba heads and the groups, or share a group when there are fewer
    (Granite 4.0-H has one); groups and ranks that divide neither way are refused."""
    from pagedserve.distributed.tp import TPContext

    shared = GraniteMoeHybridForCausalLM(granite_hybrid_config(mamba_n_groups=1),
                                         tp=TPContext(rank=1, world_size=2)).model.layers[0].mamba
    assert (shared.num_heads, shared.n_groups, shared.first_group) == (4, 1, 0)
    assert shared.norm.shared_group is not None and shared.norm.group_size == 128
    split = GraniteMoeHybridForCausalLM(granite_hybrid_config(mamba_n_groups=2),
                                        tp=TPContext(rank=1, world_size=2)).model.layers[0].mamba
    assert (split.n_groups, split.first_group, split.norm.shared_group) == (1, 1, None)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        GraniteMoeHybridForCausalLM(granite_hybrid_config(mamba_n_heads=12, mamba_n_groups=3, mamba_expand=3),
                                    tp=TPContext(rank=0, world_size=2))


@pytest.mark.parametrize("overrides", [{}, {"num_local_experts": 0, "position_embedding_type": "rope"}],
                         ids=["moe-nope", "dense-rope"])
def test_granite_moe_hybrid_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, overrides):
    """llama.cpp's "granitehybrid" GGUF (KV heads per layer, ssm.* keys, A stored as -exp(A_log),
    reshaped SSM tensors, Q/K rows permuted, the multipliers as scales) equals the HF folder;
    with Q8_0 projections kept as blocks, HF's greedy tokens by the tie rule."""
    from mamba_gguf import check_mamba_gguf, write_granite_hybrid_gguf

    hf, _, folder = hf_pair(granite_hybrid_config(**overrides), prepare=randomize_mamba)
    model = check_mamba_gguf(write_granite_hybrid_gguf, hf, folder, tmp_path, prompts(VOCAB), check_hf)
    assert [layer.mamba is None for layer in model.model.layers] == [False, True, False, False]
