"""Our GPT-BigCode (StarCoder 1 / SantaCoder: multi-query attention with one fused biased c_attn,
or multi-head with per-head q/k/v blocks; learned positions, LayerNorms, tied head) equals HF
transformers in float32."""

import pytest
import transformers

from pagedserve.models.gpt_bigcode import GPTBigCodeForCausalLM

VOCAB = 300


def bigcode_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=128,
                  multi_query=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.GPTBigCodeConfig(**kwargs)


@pytest.mark.parametrize("multi_query", [True, False], ids=["multi_query", "multi_head"])
def test_gpt_bigcode_matches_hf(hf_pair, check_hf, prompts, multi_query):
    hf, model, _ = hf_pair(bigcode_config(multi_query=multi_query))
    assert isinstance(model, GPTBigCodeForCausalLM)
    assert model.transformer.h[0].attn.num_kv_heads == (1 if multi_query else 4)
    check_hf(hf, model, prompts(VOCAB))


def write_starcoder_gguf(path, hf_model, qtype):
    """`hf_model` as convert_hf_to_gguf.py's StarCoderModel writes it (architecture "starcoder":
    4 x n_embd as the MLP width whatever n_inner is, one KV head), gguf-py's names, nothing
    permuted; 2-D weights but the embeddings as `qtype`."""
    import gguf

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "starcoder")
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(1)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.STARCODER, c.n_layer)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" or hf_name.endswith(".attn.bias"):
            continue  # (tied; the causal-mask buffer)
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        data = tensor.detach().float().numpy()
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and "wte" not in hf_name \
                and "wpe" not in hf_name:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("n_inner", [256, 128], ids=["4x", "narrow"])
def test_gpt_bigcode_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, n_inner):
    """llama.cpp's "starcoder" GGUF: F32 equals HF (the MLP width read from ffn_up where it is
    not the 4 x n_embd the file states); Q8_0 blocks kept give HF's greedy tokens by the tie rule."""
    import gguf
    import torch
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    hf, _, _ = hf_pair(bigcode_config(n_inner=n_inner))
    f32 = write_starcoder_gguf(tmp_path / "f32.gguf", hf, gguf.GGMLQuantizationType.F32)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert isinstance(model, GPTBigCodeForCausalLM) and model.transformer.h[0].attn.multi_query
    check_hf(hf, model, prompts(VOCAB))
    q8 = write_starcoder_gguf(tmp_path / "q8.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "starcoder Q8_0")
