"""Our Nemotron-H (one-mixer blocks: Mamba2 with its state in paged cache entries, NoPE
attention, relu2 MLPs, MoE blocks of relu2 experts) equals HF transformers in float32; chunking
is bit-exact."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.models.nemotron_h import NemotronHForCausalLM

VOCAB = 300
TYPES = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]


def nemotron_h_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, layers_block_type=TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.NemotronHConfig(**kwargs)


def randomize_mamba(hf):
    """A_log, D and dt_bias away from HF's init (the generic randomizer draws them small)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            m = layer.mixer
            if hasattr(m, "A_log"):
                m.A_log.copy_(torch.rand(m.A_log.shape, generator=gen) * 2 - 1)
                m.D.copy_(torch.randn(m.D.shape, generator=gen))
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen))


CASES = {
    "nemotron_h": {},
    "biases-one-group-limits": {"use_bias": True, "mlp_bias": True, "use_conv_bias": False,
                                "n_groups": 1, "time_step_limit": (0.05, 2.0)},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_nemotron_h_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(nemotron_h_config(**overrides), prepare=randomize_mamba)
    assert isinstance(model, NemotronHForCausalLM)
    specs = model.kv_cache_spec.layer_specs()
    per_mamba = model.model.layers[0].mamba.num_entries
    # entries: a Mamba block's state, none for the MLP blocks, the attention block's one
    assert len(specs) == 1 + 2 * per_mamba
    assert model.model.cache_entries_of[1] == [] and model.model.cache_entries_of[2] == [per_mamba]
    assert specs[per_mamba] == FullAttentionSpec(2, 16)
    assert specs[0] == RecurrentStateSpec(2, 16)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@torch.inference_mode()
def test_nemotron_h_chunking_is_bit_exact(hf_pair, paged_runner, prompts):
    _, model, _ = hf_pair(nemotron_h_config(), prepare=randomize_mamba)
    prompt, other = prompts(VOCAB, lengths=(15, 6))
    whole = torch.cat(paged_runner(model).step([(0, prompt)]))
    runner = paged_runner(model, seed=2)
    got = [runner.step([(0, prompt[:6]), (1, other[:2])])[0],
           runner.step([(1, other[2:]), (0, prompt[6:7])])[1],
           runner.step([(0, prompt[7:])])[0]]
    assert torch.equal(torch.cat(got), whole)


MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.7,
           layers_block_type=["linear_attention", "moe", "full_attention", "moe"])


def randomize_router_bias(hf):
    randomize_mamba(hf)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mixer, "gate"):
                bias = layer.mixer.gate.e_score_correction_bias
                bias.copy_(torch.rand(bias.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("latent", [None, 32], ids=["moe", "moe-latent"])
def test_nemotron_h_moe_matches_hf(hf_pair, check_hf, prompts, latent):
    """MoE blocks: non-gated relu2 experts, sigmoid routing with a correction bias over 2
    groups, a shared expert, and (Nemotron 3) the experts in a latent space."""
    hf, model, _ = hf_pair(nemotron_h_config(**MOE, moe_latent_size=latent), prepare=randomize_router_bias)
    moe = model.model.layers[1].mlp
    assert moe.experts.gate_proj is None and moe.routing.correction_bias
    assert (moe.fc1_latent_proj is None) == (latent is None)
    assert model.model.cache_entries_of[1] == []
    ref = hf.model.layers[1].mixer
    assert torch.equal(moe.experts.up_proj[5], ref.experts.up_proj[5])
    assert torch.equal(moe.gate.e_score_correction_bias, ref.gate.e_score_correction_bias)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("moe", [False, True], ids=["nemotron_h", "nemotron_h_moe"])
def test_nemotron_h_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, moe):
    """llama.cpp's "nemotron_h" / "nemotron_h_moe" GGUF (block types from the tensors, the RMS
    epsilon as layer_norm_epsilon, SSM tensors reshaped, experts stacked, latent projections)
    equals the HF folder; Q8_0 projections kept as blocks give HF's greedy tokens."""
    from mamba_gguf import check_mamba_gguf, write_nemotron_h_gguf

    config = nemotron_h_config(**MOE, moe_latent_size=32) if moe else nemotron_h_config()
    hf, _, folder = hf_pair(config, prepare=randomize_router_bias)
    model = check_mamba_gguf(write_nemotron_h_gguf, hf, folder, tmp_path, prompts(VOCAB), check_hf)
    assert [layer.kind for layer in model.model.layers] == list(config.layers_block_type)


def test_nemotron_h_skips_the_multi_token_prediction_head(hf_pair):
    """A checkpoint's `mtp.*` tensors (Nemotron 3's MTP head) are not loaded (an unknown name
    would be an error)."""
    from pagedserve.models.loader import iter_safetensors

    _, model, folder = hf_pair(nemotron_h_config())
    model.load_weights(list(iter_safetensors(folder)) + [("mtp.layers.0.eh_proj.weight", torch.zeros(64, 128))])
