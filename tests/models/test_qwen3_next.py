"""Our Qwen3-Next (Gated DeltaNet layers whose state lives in paged cache entries, gated
attention layers, MoE with a gated shared expert) equals HF transformers in float32, and a
prompt's logits are bit-identical however it is chunked or batched."""

import pytest
import torch
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.kernels import cpu_fp32
from pagedserve.models.qwen3_next import Qwen3NextForCausalLM

VOCAB = 300
TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def needs_invariant_kernels():
    """Bit-exactness across chunks and batches needs the batch-invariant fp32 kernels."""
    if not cpu_fp32.fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable (disabled, no AVX2/AVX-512, or build failed)")


def next_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=TYPES,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, mlp_only_layers=[2], pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Qwen3NextConfig(**kwargs)


def prefill_in_pieces(runner_cls, model, prompt, sizes, seed=0):
    """The prompt's logits `[L, V]`, fed in pieces of `sizes` (alone in each step)."""
    runner = runner_cls(model, seed=seed)
    out, fed = [], 0
    for n in sizes:
        out += runner.step([(0, prompt[fed:fed + n])])
        fed += n
    assert fed == len(prompt)
    return torch.cat(out)


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "decoder_sparse_step": 2},
                                       {"linear_num_value_heads": 2, "num_key_value_heads": 1}],
                         ids=["moe", "sparse-step", "one-kv-head"])
def test_qwen3_next_matches_hf(hf_pair, check_hf, prompts, overrides):
    hf, model, _ = hf_pair(next_config(**overrides), std=0.15)
    assert isinstance(model, Qwen3NextForCausalLM)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
    specs = model.kv_cache_spec.layer_specs()
    kv = hf.config.num_key_value_heads
    per = model.model.layers[0].linear_attn.num_entries
    assert specs[per] == FullAttentionSpec(kv, 16) and specs[0] == RecurrentStateSpec(kv, 16)
    assert len(specs) == 1 + 3 * per


def test_chunked_prefill_and_batching_are_bit_identical(hf_pair, paged_runner, prompts):
    needs_invariant_kernels()
    _, model, _ = hf_pair(next_config())
    prompt, other = prompts(VOCAB, lengths=(11, 7))
    whole = prefill_in_pieces(paged_runner, model, prompt, [11])
    for sizes in ([3, 5, 3], [1] * 11, [4, 1, 6]):
        assert torch.equal(prefill_in_pieces(paged_runner, model, prompt, sizes, seed=2), whole), sizes
    # batched with another sequence, in other chunks
    runner = paged_runner(model, seed=3)
    a = runner.step([(1, other[:4]), (0, prompt[:6])])
    b = runner.step([(0, prompt[6:]), (1, other[4:])])
    assert torch.equal(torch.cat([a[1], b[0]]), whole)


def test_bf16_cache_binds_more_entries_and_runs(hf_pair, check_hf, paged_runner, prompts):
    hf, model, _ = hf_pair(next_config())
    model.bind_cache(4, torch.float32)
    fp32_entries = model.model.layers[0].linear_attn.num_entries
    prompt = prompts(VOCAB, lengths=(9,))[0]
    ref = paged_runner(model).step([(0, prompt)])[0]
    runner = paged_runner(model, kv_dtype=torch.bfloat16)
    assert model.model.layers[0].linear_attn.num_entries == 2 * fp32_entries
    got = runner.step([(0, prompt[:5])])[0]
    got = torch.cat([got] + runner.step([(0, prompt[5:])]))
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.1  # only the attention layers' K/V are rounded to bf16


def test_qwen3_next_rejects_unknown_layer_types():
    config = next_config()
    config.layer_types = ["linear_attention", "mamba"] + TYPES[2:]  # (HF's config would rewrite it)
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3NextForCausalLM(config)
