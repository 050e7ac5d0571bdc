"""Our Bamba (Mamba2 layers whose state lives in paged cache entries, Llama attention layers
with half-rotary RoPE, SwiGLU MLPs) equals HF transformers in float32; chunking is bit-exact."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.models.bamba import BambaForCausalLM

VOCAB = 300


def bamba_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.BambaConfig(**kwargs)


def randomize_mamba(hf):
    """A_log, D and dt_bias away from HF's init (the generic randomizer draws them small)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            if getattr(layer, "mamba", None) is not None:
                m = layer.mamba
                m.A_log.copy_(torch.rand(m.A_log.shape, generator=gen) * 2 - 1)
                m.D.copy_(torch.randn(m.D.shape, generator=gen))
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen))


CASES = {
    "bamba": {},
    "biases-one-group": {"attention_bias": True, "mlp_bias": True, "mamba_proj_bias": True,
                         "mamba_conv_bias": False, "mamba_n_groups": 1},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_bamba_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(bamba_config(**overrides), prepare=randomize_mamba)
    assert isinstance(model, BambaForCausalLM)
    specs = model.kv_cache_spec.layer_specs()
    per_mamba = model.model.layers[0].mamba.num_entries
    assert len(specs) == 1 + 3 * per_mamba
    assert specs[2 * per_mamba] == FullAttentionSpec(2, 16)
    assert specs[0] == RecurrentStateSpec(2, 16)
    # half of each head rotated, as HF's config hardcodes
    assert model.model.rotary_emb(torch.tensor([3]), torch.float32)[0].shape[-1] == 8
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@torch.inference_mode()
def test_bamba_chunking_is_bit_exact(hf_pair, paged_runner, prompts):
    _, model, _ = hf_pair(bamba_config(), prepare=randomize_mamba)
    (prompt,) = prompts(VOCAB, lengths=(15,))
    whole = torch.cat(paged_runner(model).step([(0, prompt)]))
    runner = paged_runner(model, seed=2)
    chunks = [runner.step([(0, prompt[a:b])])[0] for a, b in ((0, 6), (6, 7), (7, 15))]
    assert torch.equal(torch.cat(chunks), whole)


def test_bamba_rejects_attention_layers_out_of_range():
    with pytest.raises(ValueError, match="attn_layer_indices"):
        BambaForCausalLM(bamba_config(attn_layer_indices=[4]))


def test_bamba_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp writes Bamba as "granitehybrid" (RoPE on: rope.scaling.finetuned; half of each
    head rotated; no Granite scales or experts): loaded as Bamba, equal to the HF folder; Q8_0
    projections kept as blocks give HF's greedy tokens."""
    from mamba_gguf import check_mamba_gguf, write_granite_hybrid_gguf

    hf, _, folder = hf_pair(bamba_config(), prepare=randomize_mamba)
    check_mamba_gguf(write_granite_hybrid_gguf, hf, folder, tmp_path, prompts(VOCAB), check_hf)
