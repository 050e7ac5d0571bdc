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


def test_mixtral_kept_q8_0_with_batch_invariant_is_the_same_alone_and_among_fifteen(hf_pair, tmp_path):
    """`--batch-invariant` (`load_model(batch_invariant=True)`: every expert's product on the
    8-bit GEMV at any row count, kernels/cpu_moe.py) keeps its promise for MoE: a request's bf16
    logits over Q8_0 experts, prompt and decode, are bit-identical alone and in a batch of 16
    (where each expert holds ~30 rows: the 8-bit GEMM's range without the flag)."""
    import torch
    from moe_gguf import write_moe_gguf
    from utils import PagedRunner

    from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
    from pagedserve.models.loader import iter_safetensors, load_model

    hf, _, folder = hf_pair(mixtral_config(sliding_window=None, hidden_size=128, intermediate_size=64))
    Q = __import__("gguf").GGMLQuantizationType
    path = write_moe_gguf(tmp_path / "q8.gguf", "mixtral", hf.config, dict(iter_safetensors(folder)),
                          types={".experts.": Q.Q8_0, "_proj": Q.F16})
    config = load_gguf_config(path, cache_dir=tmp_path / "cache")
    model = load_model(config, weights=iter_gguf_weights(path, config, keep_quantized=True),
                       dtype=torch.bfloat16, quantization="gguf", batch_invariant=True)
    assert model.model.layers[0].mlp.experts.down_proj.quant.batch_invariant
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (8,), generator=gen).tolist() for _ in range(16)]

    def run(batch: list[int]) -> list[torch.Tensor]:  # request 0's logits: prompt, 3 decode steps
        runner = PagedRunner(model, num_blocks=64)
        outs = runner.step([(i, prompts[i]) for i in batch])
        got = [outs[0]]
        for _ in range(3):
            outs = runner.step([(i, [int(o[-1].argmax())]) for i, o in zip(batch, outs)])
            got.append(outs[0])
        return got

    alone, batched = run([0]), run(list(range(16)))
    for step, (a, b) in enumerate(zip(alone, batched)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max()}"
