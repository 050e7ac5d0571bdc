"""More dense families from GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them
(each converter's metadata keys, gguf-py's tensor names, its tensor changes): Jais 2 ("jais2"),
EXAONE 4.5's text decoder ("exaone4"), BitNet b1.58 ("bitnet"). Our GGUF run equals the HF run
in float32; Q8_0 projections kept as blocks give greedy tokens in HF's top 5.
(scripts/check_gguf_converter.py runs the real converter.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from test_gguf_dense_families import _load, assert_greedy_in_hf_top5

VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # Jais 2: LayerNorms with biases, relu^2 MLP with biases, biased attention (RoPE base 500)
    "jais2": lambda: transformers.Jais2Config(**_COMMON, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 500.0}),
}
ARCH = {}  # test case -> GGUF architecture


def _metadata(writer: gguf.GGUFWriter, arch: str, c) -> None:
    """The keys each family's converter class writes (set_gguf_parameters)."""
    writer.add_context_length(c.max_position_embeddings)  # (conversion/base.py's TextModel)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "jais2":  # conversion/jais.py's Jais2Model
        writer.add_layer_norm_eps(c.layer_norm_eps)
        writer.add_rope_dimension_count(c.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensors(arch: str, hf_model):
    """`(gguf-py's name of the HF tensor, float32 data)` as the converter writes them."""
    c = hf_model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    tied = getattr(c, "tie_word_embeddings", False)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        yield f"{name_map.get_name(base)}.{suffix}", tensor.detach().numpy().astype(np.float32)


def write_gguf(path, case: str, hf_model, qtype=gguf.GGMLQuantizationType.F32):
    """`hf_model` as llama.cpp's converter writes it; 2-D weights other than the embedding as
    `qtype`."""
    arch = ARCH.get(case, case)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _metadata(writer, arch, hf_model.config)
    for name, data in _tensors(arch, hf_model):
        if qtype != gguf.GGMLQuantizationType.F32 and data.ndim == 2 and "embd" not in name and "norm" not in name:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", list(CONFIGS))
def test_gguf_equals_the_hf_run(case, hf_pair, check_hf, prompts, tmp_path):
    hf, ours_hf, _ = hf_pair(CONFIGS[case]())
    path = write_gguf(tmp_path / f"{case}.gguf", case, hf)
    config, model = _load(path, tmp_path)
    assert type(model) is type(ours_hf)
    assert config.num_hidden_layers == 4 and config.vocab_size == VOCAB
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_q8_0_gguf_keeps_projections_as_blocks(case, hf_pair, tmp_path):
    hf, _, _ = hf_pair(CONFIGS[case]())
    path = write_gguf(tmp_path / f"{case}-q8.gguf", case, hf, gguf.GGMLQuantizationType.Q8_0)
    _, model = _load(path, tmp_path, keep_quantized=True)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.dtype == torch.uint8 and attn.k_proj.weight.quant.format.name == "q8_0"
    assert_greedy_in_hf_top5(hf, model)
