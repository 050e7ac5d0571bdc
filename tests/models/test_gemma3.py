"""Our Gemma3 equals HF transformers: sliding/global layer types with separate RoPE bases,
query_pre_attn_scalar, Gemma norms, scaled embeddings, final logit softcapping."""

import pytest
import torch
import transformers
from utils import PagedRunner

import pagedserve.platforms.cpu as cpu_platform
from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa
from pagedserve.kernels.cpu_isa import ISA_LEVELS
from pagedserve.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

VOCAB = 512


def tiny_gemma3_text(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,  # != head_dim
        sliding_window=6,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=3.0,
        pad_token_id=0,
    )
    return transformers.Gemma3TextConfig(**{**base, **kw})


def test_gemma3_layer_types_window_and_rope_bases(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_gemma3_text(), std=0.15)
    assert isinstance(model, Gemma3ForCausalLM)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [6, 6, 6, None]
    assert model.model.layers[0].self_attn.attn.scale == pytest.approx(24**-0.5)
    ropes = model.model.rotary_emb
    assert ropes["sliding_attention"].params["rope_theta"] == 10000.0
    assert ropes["full_attention"].params["rope_type"] == "linear"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def test_gemma3_softcap_bounds_logits(paged_runner, hf_pair):
    _, model, _ = hf_pair(tiny_gemma3_text())
    (logits,) = paged_runner(model).step([(0, list(range(1, 8)))])
    assert logits.abs().max() <= 3.0


def test_gemma3_old_style_config_with_pattern(hf_pair, check_hf, prompts):
    """transformers-4 style: rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern."""

    def old_style(cfg):
        for key in ("rope_parameters", "layer_types"):
            cfg.pop(key, None)
        cfg.update(
            rope_theta=50_000.0,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            sliding_window_pattern=2,
        )
        return cfg

    hf, model, _ = hf_pair(tiny_gemma3_text(final_logit_softcapping=None), edit_config=old_style, std=0.15)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [6, None, 6, None]
    assert model.model.rotary_emb["sliding_attention"].params["rope_theta"] == 100.0
    assert model.model.rotary_emb["full_attention"].params["rope_theta"] == 50_000.0
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def test_gemma3_conditional_generation_text_path(hf_pair, check_hf, prompts):
    config = transformers.Gemma3Config(
        text_config=tiny_gemma3_text(final_logit_softcapping=None).to_dict(),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    )
    hf, model, _ = hf_pair(config, hf_class=transformers.Gemma3ForConditionalGeneration, std=0.15)
    assert isinstance(model, Gemma3ForConditionalGeneration)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 10)))


def test_gemma3_bidirectional_is_rejected():
    from pagedserve.models.loader import load_model

    with pytest.raises(NotImplementedError):
        load_model(tiny_gemma3_text(use_bidirectional_attention=True), weights=None, dtype=torch.float32)


@pytest.mark.slow
def test_embedded_gemma3_270m_matches_hf(paged_runner, embedded_gguf_path, embedded_hf_reference,
                                         embedded_hf_model):
    """The real Gemma 3 270M (the embedded GGUF's weights as transformers reads them, float32)
    equals HF on a prompt longer than its 512-token sliding window, in one prefill and when
    continued by decode steps. (That we read the same weights: test_gguf_loader.py.)"""
    from pagedserve.models.gguf_loader import load_gguf_config
    from pagedserve.models.loader import load_model

    config = load_gguf_config(embedded_gguf_path)
    # clone: the session's reference tensors stay untouched whatever the loader does in place
    weights = ((name, t.clone()) for name, t in embedded_hf_reference.state_dict.items())
    model = load_model(config, weights=weights, dtype=torch.float32)
    hf = embedded_hf_model
    gen = torch.Generator().manual_seed(0)
    n, prefill = 560, 555  # longer than the window; the last 5 tokens come as decode steps
    long, short = (torch.randint(0, 4000, (k,), generator=gen).tolist() for k in (n, 9))
    # NOTE: logits of a sample of positions (each is 262k wide; all 560 cost ~25 s a side): a
    # stride through the window, every position past it, and the decode steps.
    rows = sorted(set(range(0, prefill, 29)) | set(range(500, prefill)))
    with torch.no_grad():
        ref_long = hf(input_ids=torch.tensor([long]),
                      logits_to_keep=torch.tensor(rows + list(range(prefill, n)))).logits[0]
        ref_short = hf(input_ids=torch.tensor([short])).logits[0]
    runner = paged_runner(model, block_size=16, num_blocks=64)
    out_long, out_short = runner.step([(0, long[:prefill]), (1, short)],
                                      keep=[rows, list(range(len(short)))])
    torch.testing.assert_close(out_long, ref_long[:len(rows)], atol=2e-3, rtol=0)
    torch.testing.assert_close(out_short, ref_short, atol=2e-3, rtol=0)
    for i in range(prefill, n):
        (out,) = runner.step([(0, [long[i]])])
        torch.testing.assert_close(out[0], ref_long[len(rows) + i - prefill], atol=2e-3, rtol=0)


def test_gemma3_bfloat16_with_fused_cpu_kernels_tracks_hf_bfloat16(hf_pair, check_hf, prompts, monkeypatch):
    """bf16 on CPU runs the fused kernels (q/k norm + RoPE, RMSNorm, decode attention, GEMV where
    the CPU has them); HF bf16 runs the eager ops. Same roundings, so logits agree to bf16 noise
    through prefill, chunked prefill and decode steps."""
    _, model, folder = hf_pair(tiny_gemma3_text(final_logit_softcapping=None), std=0.15,
                               dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ps = prompts(VOCAB, lengths=(13, 5, 10))
    with torch.no_grad():
        refs = [hf(input_ids=torch.tensor([p])).logits[0].float() for p in ps]

    def prefill_error():
        outs = PagedRunner(model).step(list(enumerate(ps)))
        return max(float((out - ref).abs().max()) for out, ref in zip(outs, refs))

    # Prefill: the same roundings as HF's eager ops (an extra rounding in the q/k norm alone
    # moves logits by ~0.09). NOTE: this tiny model (std 0.15) turns one flipped bf16 rounding
    # into ~0.06 of logits. Our prefill attention kernel sums q.k and p.v as oneDNN's bf16 dot
    # products do on AVX512-BF16 (bit-identical to HF's SDPA there), but in another fp32 order on
    # AVX2 CPUs: there the strict bound holds for the other fused kernels with SDPA's prefill
    # attention, and the kernel itself stays within a few flipped roundings.
    if linear_isa() >= ISA_LEVELS["avx512bf16"] or not kernel_available():
        assert prefill_error() < 0.02
    else:
        assert prefill_error() < 0.1
        monkeypatch.setattr(cpu_platform, "prefill_attention", lambda *args: False)
        assert prefill_error() < 0.02
        monkeypatch.undo()
    # Decode steps attend in fp32 (HF: bf16 SDPA): a few bf16 steps of difference.
    check_hf(hf, model, ps, tol=0.1)
