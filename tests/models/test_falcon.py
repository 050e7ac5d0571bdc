"""Our Falcon (rotary; its three fused q/k/v layouts -- grouped KV (40B / 180B), multi-query (7B),
per-head --; parallel blocks on one or two LayerNorms, or sequential blocks; biases) equals HF
transformers in float32; ALiBi is refused."""

import pytest
import torch
import transformers

from pagedserve.models.falcon import FalconForCausalLM

VOCAB = 300


def falcon_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, alibi=False, bias=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    kwargs.update(overrides)
    return transformers.FalconConfig(**kwargs)


LAYOUTS = {
    "falcon_40b": dict(new_decoder_architecture=True, num_kv_heads=2),  # grouped KV, ln_attn / ln_mlp
    "new_arch_one_ln": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "falcon_7b": dict(multi_query=True, parallel_attn=True),  # one KV head, a parallel block
    "sequential_mha": dict(multi_query=False, parallel_attn=False, bias=True),  # per-head q/k/v, biases
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_falcon_matches_hf(hf_pair, check_hf, prompts, layout):
    hf, model, _ = hf_pair(falcon_config(**LAYOUTS[layout]))
    assert isinstance(model, FalconForCausalLM)
    check_hf(hf, model, prompts(VOCAB))


def test_falcon_alibi_is_refused():
    with pytest.raises(ValueError, match="alibi"):
        FalconForCausalLM(falcon_config(alibi=True))


def write_falcon_gguf(path, hf_model, qtype):
    """`hf_model` as convert_hf_to_gguf.py's FalconModel writes it: context 2048, MLP width 4 x
    hidden, no RoPE base nor block kind; `attn_qkv` rearranged ("jploski": every query head, then
    every key head, then every value head); 2-D weights but the embeddings as `qtype`."""
    import gguf
    import numpy as np

    c = hf_model.config
    heads, d = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    kv = c.num_kv_heads if c.new_decoder_architecture else 1
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_context_length(2048)
    w.add_tensor_data_layout("jploski")
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(4 * c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON, c.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.detach().float()
        if "query_key_value" in hf_name:  # the converter's modify_tensors
            qkv = data.reshape(kv, heads // kv + 2, d, -1)
            data = torch.cat((qkv[:, :-2].reshape(heads * d, -1), qkv[:, [-2]].reshape(kv * d, -1),
                              qkv[:, [-1]].reshape(kv * d, -1))).reshape(data.shape)
        data = data.numpy()
        name = f"{name_map.get_name(base)}.{suffix}"
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and "word_embeddings" not in hf_name:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("layout", ["falcon_40b", "new_arch_one_ln", "falcon_7b"])
def test_falcon_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, layout):
    """llama.cpp's "falcon" GGUF (the parallel layouts llama.cpp runs): F32 equals HF, the
    rearranged q/k/v rows put back; Q8_0 blocks kept give HF's greedy tokens by the tie rule."""
    import gguf
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    hf, _, _ = hf_pair(falcon_config(**LAYOUTS[layout], bias=True))
    f32 = write_falcon_gguf(tmp_path / "f32.gguf", hf, gguf.GGMLQuantizationType.F32)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert isinstance(model, FalconForCausalLM)
    check_hf(hf, model, prompts(VOCAB))
    q8 = write_falcon_gguf(tmp_path / "q8.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], f"falcon {layout} Q8_0")
