"""Our Mixtral (softmax router, top-2 renormalized, SwiGLU experts w1/w3/w2, sliding window)
equals HF transformers in float32."""

import transformers

from pagedserve.models.mixtral import MixtralForCausalLM

VOCAB = 300


def mixtral_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, sliding_window=7, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.MixtralConfig(**kwargs)


def test_mixtral_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(mixtral_config())
    assert isinstance(model, MixtralForCausalLM)
    moe = model.model.layers[0].mlp
    assert moe.experts.gate_proj.shape == (8, 32, 64) and moe.experts.down_proj.shape == (8, 64, 32)
    check_hf(hf, model, prompts(VOCAB))


def test_mixtral_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    from moe_gguf import check_gguf_family

    hf, _, folder = hf_pair(mixtral_config(sliding_window=None))
    check_gguf_family("mixtral", hf, folder, tmp_path, prompts(VOCAB), check_hf)


def test_mixtral_kept_q5_0_with_batch_invariant_experts_are_the_same_alone_and_among_forty(tmp_path):
    """`--batch-invariant` (`load_model(batch_invariant=True)`: every expert's product on the
    8-bit GEMV at any row count, kernels/cpu_moe.py) keeps its promise for MoE: a Q5_0 GGUF
    Mixtral's experts give each token the same float32 sum alone as among 41 tokens (each expert
    then holds ~10 rows: the 8-bit GEMM's range without the flag, whose sums round differently
    at this shape: the check fails without the flag). (A model's bf16 logits hide most such
    differences in their roundings, so the check is on the experts' sum.)"""
    import torch
    from moe_gguf import write_moe_gguf

    from pagedserve.layers.moe import select_experts
    from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
    from pagedserve.models.loader import iter_safetensors, load_model

    hf_config = mixtral_config(sliding_window=None, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=1)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path / "hf")  # the checkpoint's per-expert names, as a converter reads them
    Q = __import__("gguf").GGMLQuantizationType
    path = write_moe_gguf(tmp_path / "q5.gguf", "mixtral", hf_config, dict(iter_safetensors(tmp_path / "hf")),
                          types={".experts.": Q.Q5_0, "_proj": Q.F16})
    config = load_gguf_config(path, cache_dir=tmp_path / "cache")
    model = load_model(config, weights=iter_gguf_weights(path, config, keep_quantized=True),
                       dtype=torch.bfloat16, quantization="gguf", batch_invariant=True)
    moe = model.model.layers[0].mlp
    assert moe.experts.down_proj.quant.format.name == "q5_0"
    x = torch.randn(41, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        weights, ids = select_experts(moe.gate(x), moe.routing)
        full = moe.experts(x, weights, ids)  # [41, H] fp32
        for i in range(41):
            alone = moe.experts(x[i:i + 1], weights[i:i + 1], ids[i:i + 1])
            assert torch.equal(alone[0], full[i]), f"token {i}"
