"""Our Kimi Linear (Kimi Delta Attention -- a gated delta rule with a per-key-channel decay --
whose state lives in latent-shaped cache entries beside NoPE MLA layers, DeepSeek-V3 routed
experts) equals HF transformers in float32; chunking and batching are bit-exact; the kernel
and the torch loop give the same tokens."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import KVLayout, MLASpec, RecurrentStateSpec
from pagedserve.layers.kimi_delta_attention import KimiDeltaAttention
from pagedserve.layers.mla import MLAttention
from pagedserve.layers.moe import FusedMoE
from pagedserve.models.kimi_linear import KimiLinearForCausalLM

VOCAB = 320


def kimi_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.KimiLinearConfig(**kwargs)


def randomize_kda(hf):
    """A_log, dt_bias and the routers' correction biases away from the generic randomizer's draws
    (decays spread over (0, 1), the biases moving the choice)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "forget_gate"):
                gate = attn.forget_gate
                gate.A_log.copy_(torch.rand(gate.A_log.shape, generator=gen) * 2 - 1.5)
                gate.dt_bias.copy_(torch.randn(gate.dt_bias.shape, generator=gen))
            router = getattr(layer.mlp, "gate", None)
            if router is not None and hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(torch.rand(router.e_score_correction_bias.shape, generator=gen))


CASES = {
    "kimi-linear": {},
    # MLA first, a low-rank q projection, one dense layer in the middle
    "mla-first-q-lora": {"layer_types": ["full_attention", "linear_attention", "linear_attention"],
                         "mlp_layer_types": ["sparse", "dense", "sparse"], "q_lora_rank": 24},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_kimi_linear_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(kimi_config(**overrides), prepare=randomize_kda)
    assert isinstance(model, KimiLinearForCausalLM)
    kinds = [type(layer.self_attn) for layer in model.model.layers]
    linear = [k is KimiDeltaAttention for k in kinds]
    assert linear == [t == "linear_attention" for t in hf.config.layer_types]
    assert all(k is MLAttention for k, lin in zip(kinds, linear) if not lin)
    assert [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers] == \
        [t == "sparse" for t in hf.config.mlp_layer_types]
    specs = model.kv_cache_spec.layer_specs()
    assert set(specs) == {MLASpec(24), RecurrentStateSpec(1, 24, num_tensors=1)}
    assert len({s.page_shape() for s in specs}) == 1  # one pool of one block size
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@torch.no_grad()
def test_kimi_linear_chunking_and_batching_are_bit_exact(hf_pair, paged_runner, prompts):
    _, model, _ = hf_pair(kimi_config(), prepare=randomize_kda)
    first, other = prompts(VOCAB, lengths=(15, 6))
    whole = torch.cat(paged_runner(model).step([(0, first)]))
    runner = paged_runner(model, seed=2)
    chunks = [runner.step([(0, first[a:b])])[0] for a, b in ((0, 6), (6, 7), (7, 15))]
    assert torch.equal(torch.cat(chunks), whole)
    runner = paged_runner(model, seed=3)
    singles = [runner.step([(0, [tok])])[0] for tok in first]
    assert torch.equal(torch.cat(singles), whole)
    runner = paged_runner(model, seed=4)
    a1, b1 = runner.step([(0, first[:9]), (1, other[:2])])
    a2, b2 = runner.step([(0, first[9:]), (1, other[2:])])
    assert torch.equal(torch.cat([a1, a2]), whole)
    assert torch.equal(torch.cat([b1, b2]), torch.cat(paged_runner(model).step([(0, other)])))


def test_kimi_linear_torch_loop_equals_the_kernel(hf_pair, paged_runner, prompts, monkeypatch):
    from pagedserve.platforms.cpu import CpuOps

    _, model, _ = hf_pair(kimi_config(), prepare=randomize_kda)
    prompt = prompts(VOCAB, lengths=(11,))[0]
    kernel = paged_runner(model).step([(0, prompt)])[0]
    monkeypatch.setattr(CpuOps, "kimi_delta_rule_paged", lambda *args: None)
    loop = paged_runner(model).step([(0, prompt)])[0]
    torch.testing.assert_close(loop, kernel, rtol=1e-5, atol=1e-5)


def test_kimi_linear_layout_and_refusals():
    model = KimiLinearForCausalLM(kimi_config())
    layout = KVLayout.from_specs(model.kv_cache_spec.layer_specs())
    assert sorted(g.name for g in layout.groups) == ["mla", "state"]
    assert layout.page_spec.page_shape() == (1, 1, 24)
    # every layer one group (disable_hybrid_kv_cache_manager): the state's entries as latent ones
    flat = KVLayout.from_specs(model.kv_cache_spec.layer_specs(), hybrid=False)
    assert flat.page_spec == MLASpec(24)
    from pagedserve.distributed.tp import TPContext

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        KimiLinearForCausalLM(kimi_config(), tp=TPContext(rank=0, world_size=2))
    config = kimi_config()
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        KimiLinearForCausalLM(config)
