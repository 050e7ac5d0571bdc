"""Our pure state-space LMs -- Mamba (Mamba 1 mixers), Falcon Mamba (with weightless dt / B / C
norms), Mamba2 -- whose only cache entries are their layers' states (a page fitted to the
state: no attention layer sets one) equal HF transformers in float32; chunking and batching are
bit-exact; a bf16 model keeps HF's float32 residual stream."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import KVLayout, RecurrentStateSpec
from pagedserve.layers.mamba1 import Mamba1Mixer
from pagedserve.layers.mamba2 import Mamba2Mixer
from pagedserve.layers.recurrent_state import fitted_page
from pagedserve.models.mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM

VOCAB = 304


def mamba_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=3, expand=2,
                  conv_kernel=4, time_step_rank=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.MambaConfig(**kwargs)


def falcon_mamba_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=3, expand=2,
                  conv_kernel=4, time_step_rank=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  mixer_rms_eps=1e-5)
    kwargs.update(overrides)
    return transformers.FalconMambaConfig(**kwargs)


def mamba2_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=8, n_groups=2,
                  num_hidden_layers=3, expand=2, conv_kernel=4, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, chunk_size=8)
    kwargs.update(overrides)
    return transformers.Mamba2Config(**kwargs)


def randomize_ssm(hf):
    """A_log, D and the dt biases away from the generic randomizer's small draws."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.backbone.layers:
            m = layer.mixer
            m.A_log.copy_(torch.rand(m.A_log.shape, generator=gen) * 2 - 1)
            m.D.copy_(torch.randn(m.D.shape, generator=gen))
            bias = m.dt_proj.bias if hasattr(m, "dt_proj") else m.dt_bias
            bias.copy_(torch.randn(bias.shape, generator=gen))


CASES = {
    "mamba": (mamba_config, MambaForCausalLM, {}),
    "mamba-biases-auto-rank-untied": (mamba_config, MambaForCausalLM,
                                      {"use_bias": True, "use_conv_bias": False, "time_step_rank": "auto",
                                       "tie_word_embeddings": False}),
    "falcon-mamba": (falcon_mamba_config, FalconMambaForCausalLM, {}),
    "mamba2": (mamba2_config, Mamba2ForCausalLM, {}),
    "mamba2-one-group-biases-dt-limit": (mamba2_config, Mamba2ForCausalLM,
                                         {"n_groups": 1, "use_bias": True, "time_step_limit": (0.05, 2.0)}),
}


@pytest.mark.parametrize("make, cls, overrides", CASES.values(), ids=CASES.keys())
def test_matches_hf(hf_pair, check_hf, prompts, make, cls, overrides):
    hf, model, _ = hf_pair(make(**overrides), prepare=randomize_ssm)
    assert type(model) is cls
    mixer = model.model.layers[0].mamba
    assert isinstance(mixer, Mamba2Mixer if cls is Mamba2ForCausalLM else Mamba1Mixer)
    # no attention: only state entries, of the page the state fitted itself
    specs = model.kv_cache_spec.layer_specs()
    assert len(specs) == 3 * mixer.num_entries
    assert set(specs) == {RecurrentStateSpec(1, fitted_page(mixer.state.numel) // 2)}
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_a_state_only_layout_is_one_state_group_and_a_fitted_page_holds_a_state():
    model = MambaForCausalLM(mamba_config())
    mixer = model.model.layers[0].mamba
    floats = 3 * 128 + 128 * 8  # conv rows, SSM state
    assert mixer.state.page == 2 * -(-floats // 32) and mixer.num_entries == 1  # 16 float32 tokens
    layout = KVLayout.from_specs(model.kv_cache_spec.layer_specs())
    assert [g.name for g in layout.groups] == ["state"] and layout.state_columns() == (0,)
    assert layout.blocks_per_request(1000, 16, 64) == 1
    model.bind_cache(4, torch.bfloat16)
    assert mixer.num_entries == 8 and model.kv_cache_spec.num_layers == 24


@pytest.mark.parametrize("make", [mamba_config, mamba2_config], ids=["mamba", "mamba2"])
@torch.inference_mode()
def test_chunking_and_batching_are_bit_exact(hf_pair, paged_runner, prompts, make):
    _, model, _ = hf_pair(make(), prepare=randomize_ssm)
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


@pytest.mark.parametrize("make", [mamba_config, mamba2_config], ids=["mamba", "mamba2"])
@torch.no_grad()
def test_bf16_keeps_hf_float32_residual_stream(hf_pair, paged_runner, prompts, make):
    hf, model, folder = hf_pair(make(), prepare=randomize_ssm, dtype=torch.bfloat16)
    prompt = prompts(VOCAB, lengths=(9,))[0]
    streams = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, args, out: streams.append(out.dtype))
    ours = paged_runner(model).step([(0, prompt)])[0].float()
    assert streams == [torch.float32] * 3  # (HF's residual_in_fp32, on by default)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ref = hf16(input_ids=torch.tensor([prompt])).logits[0].float()
    # the bf16 roundings of the projections (and the kernels) apart, both run alike
    assert (ours - ref).abs().max() < 0.15 * ref.abs().max()
    _, off, _ = hf_pair(make(residual_in_fp32=False), prepare=randomize_ssm, dtype=torch.bfloat16, seed=1)
    streams.clear()
    for layer in off.model.layers:
        layer.register_forward_hook(lambda m, args, out: streams.append(out.dtype))
    paged_runner(off).step([(0, prompt)])
    assert streams == [torch.bfloat16] * 3


def test_tensor_parallel_splits_the_channels_and_heads():
    from pagedserve.distributed.tp import TPContext

    half = MambaForCausalLM(mamba_config(), tp=TPContext(rank=1, world_size=2)).model.layers[0].mamba
    assert half.inter == 64 and half.A_log.shard.ranges == ((64, 128),)
    half2 = Mamba2ForCausalLM(mamba2_config(), tp=TPContext(rank=1, world_size=2)).model.layers[0].mamba
    assert half2.num_heads == 4 and half2.n_groups == 1 and half2.first_group == 1
    config = mamba2_config()
    config.__dict__["num_heads"] = 4  # (HF validates it too; a raw config need not)
    with pytest.raises(ValueError, match="num_heads"):
        Mamba2ForCausalLM(config)


@pytest.mark.parametrize("make", [mamba_config, falcon_mamba_config, mamba2_config],
                         ids=["mamba", "falcon-mamba", "mamba2"])
def test_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, make):
    """llama.cpp's "mamba" (Falcon Mamba: `ssm.dt_b_c_rms`) and "mamba2": equal to the HF folder;
    Q8_0 projections kept as blocks give HF's greedy tokens."""
    from mamba_gguf import check_mamba_gguf, write_mamba_gguf

    hf, _, folder = hf_pair(make(), prepare=randomize_ssm)
    model = check_mamba_gguf(write_mamba_gguf, hf, folder, tmp_path, prompts(VOCAB), check_hf)
    assert model.config.model_type == hf.config.model_type
    assert model.tied == hf.config.tie_word_embeddings


def test_no_position_limit_serves_any_requested_context():
    from pagedserve.engine.context_length import served_max_model_len

    config = mamba_config()
    assert served_max_model_len(None, config, config) == 2048
    assert served_max_model_len(100_000, config, config) == 100_000
    llama = transformers.LlamaConfig(max_position_embeddings=512)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        served_max_model_len(1024, llama, llama)
