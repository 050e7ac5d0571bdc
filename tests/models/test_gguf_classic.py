"""The older dense families (models/gguf_classic.py) from GGUF files written as llama.cpp's
convert_hf_to_gguf.py writes them (each converter's metadata keys, gguf-py's tensor names and
its tensor changes): our GGUF run equals the HF run in float32; Q8_0 projections kept as blocks
give greedy tokens in HF's top 5. (scripts/check_gguf_converter.py runs the real converter.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from test_gguf_dense_families import _load, _permute, assert_greedy_in_hf_top5

VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _rope(partial: float, theta: float = 10000.0) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}


_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
           "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # (the context llama.cpp's reader assumes)
CONFIGS = {
    # Phi-2: the converter writes feed_forward_length 4 x hidden whatever the MLP's width (96 here)
    "phi2": lambda: transformers.PhiConfig(**{**_COMMON, "intermediate_size": 96}, rope_parameters=_rope(0.5)),
    # StableLM 2 12B: parallel block, per-head q/k norms (stacked by the converter), GQA
    "stablelm": lambda: transformers.StableLmConfig(**{**_COMMON, "num_key_value_heads": 2}, use_parallel_residual=True,
                                                    qk_layernorm=True, rope_parameters=_rope(0.25)),
    # StableLM 2 1.6B: sequential, q/k/v biases
    "stablelm_bias": lambda: transformers.StableLmConfig(**_COMMON, use_qkv_bias=True, rope_parameters=_rope(0.5)),
    # StarCoder 2 with biases (its window: none, as llama.cpp runs it; see models/gguf_classic.py)
    "starcoder2": lambda: transformers.Starcoder2Config(**{**_COMMON, "num_key_value_heads": 2}, use_bias=True,
                                                        sliding_window=None, rope_parameters=_rope(1.0, 500.0)),
    # Pythia: parallel residual, a quarter of each head rotated; sequential, half rotated
    "gptneox": lambda: transformers.GPTNeoXConfig(**_COMMON, rope_parameters=_rope(0.25)),
    "gptneox_seq": lambda: transformers.GPTNeoXConfig(**_COMMON, use_parallel_residual=False,
                                                      rope_parameters=_rope(0.5)),
    # OLMo: weightless norms (no tensors), q/k/v clamped
    "olmo": lambda: transformers.OlmoConfig(**{**_COMMON, "num_key_value_heads": 2}, clip_qkv=0.8),
    # Arcee: relu^2 MLP with biases, Llama's permuted Q/K (biases too)
    "arcee": lambda: transformers.ArceeConfig(**{**_COMMON, "num_key_value_heads": 2}, attention_bias=True,
                                              mlp_bias=True),
    # Nemotron: layernorm1p (stored 1 + w), half-rotary, biases
    "nemotron": lambda: transformers.NemotronConfig(**{**_COMMON, "num_key_value_heads": 2}, head_dim=16,
                                                    attention_bias=True, mlp_bias=True, rope_parameters=_rope(0.5)),
    # Apertus: xIELU scalars per layer (metadata), q/k norms, Llama 3 RoPE (a rope_freqs tensor)
    "apertus": lambda: transformers.ApertusConfig(**{**_COMMON, "num_key_value_heads": 2}, head_dim=16,
                                                  rope_parameters=_LLAMA3),
}
ARCH = {"stablelm_bias": "stablelm", "gptneox_seq": "gptneox"}  # test case -> GGUF architecture


def _metadata(writer: gguf.GGUFWriter, arch: str, c) -> None:
    """The keys each family's converter class writes (set_gguf_parameters)."""
    head_dim = c.hidden_size // c.num_attention_heads
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    if arch == "phi2":  # conversion/phi.py Phi2Model
        writer.add_feed_forward_length(4 * c.hidden_size)
        writer.add_head_count_kv(c.num_attention_heads)
        writer.add_layer_norm_eps(c.layer_norm_eps)
        writer.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * c.hidden_size)
                                        // c.num_attention_heads)
    if arch == "stablelm":  # conversion/stablelm.py
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * head_dim))
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_parallel_residual(c.use_parallel_residual)
        writer.add_layer_norm_eps(c.layer_norm_eps)
    if arch == "starcoder2":  # the base class's keys (conversion/base.py)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_layer_norm_eps(c.norm_epsilon)
    if arch == "gptneox":  # conversion/gptneox.py
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * head_dim))
        writer.add_parallel_residual(c.use_parallel_residual)
        writer.add_layer_norm_eps(c.layer_norm_eps)
    if arch in ("olmo", "arcee", "nemotron", "apertus"):  # the base class's keys (conversion/base.py)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "olmo":  # conversion/olmo.py
        writer.add_layer_norm_eps(1e-5)
        if c.clip_qkv is not None:
            writer.add_clamp_kqv(c.clip_qkv)
    if arch in ("arcee", "apertus"):  # conversion/llama.py's LlamaModel
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(c.head_dim)
    if arch == "apertus":
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch == "nemotron":  # conversion/nemotron.py
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_vocab_size(c.vocab_size)
        writer.add_layer_norm_eps(c.norm_eps)
        writer.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * c.hidden_size)
                                        // c.num_attention_heads)
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensors(arch: str, hf_model, fuse_qkv: bool):
    """`(gguf-py's name of the HF tensor, float32 data)` as the converter writes them."""
    c = hf_model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    tied = getattr(c, "tie_word_embeddings", False)
    for hf_name, data in state.items():
        if hf_name == "lm_head.weight" and tied or ".act_fn." in hf_name:  # (xIELU: metadata)
            continue
        if arch in ("olmo", "arcee") and (".q_proj.weight" in hf_name or arch == "arcee" and ".q_proj." in hf_name):
            data = _permute(data, c.num_attention_heads)
        if arch in ("olmo", "arcee") and (".k_proj.weight" in hf_name or arch == "arcee" and ".k_proj." in hf_name):
            data = _permute(data, c.num_key_value_heads)
        if arch == "nemotron" and hf_name.endswith("norm.weight"):
            data = data + 1
        if ".norms." in hf_name:  # StableLM's per-head q/k norms: stacked [heads, D] after the last
            stem, head = hf_name.rsplit(".norms.", 1)
            heads = c.num_attention_heads if stem.endswith("q_layernorm") else c.num_key_value_heads
            if head == f"{heads - 1}.weight":
                leaf = "attn_q_norm" if stem.endswith("q_layernorm") else "attn_k_norm"
                bid = stem.split(".")[2]
                yield f"blk.{bid}.{leaf}.weight", np.stack([state[f"{stem}.norms.{i}.weight"] for i in range(heads)])
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if ".query_key_value." in hf_name:  # GPT-NeoX: the converter regroups the heads' q|k|v
            heads = c.num_attention_heads
            data = data.reshape(heads, 3, -1, *data.shape[1:]).swapaxes(0, 1).reshape(data.shape)
        if fuse_qkv and ".self_attn.q_proj." in hf_name:  # an original phi-2's Wqkv: one attn_qkv
            k, v = state[hf_name.replace("q_proj", "k_proj")], state[hf_name.replace("q_proj", "v_proj")]
            yield name_map.get_name(base).replace("attn_q", "attn_qkv") + f".{suffix}", np.concatenate([data, k, v])
            continue
        if fuse_qkv and (".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name):
            continue
        yield f"{name_map.get_name(base)}.{suffix}", data


def _apertus_extras(writer: gguf.GGUFWriter, hf_model) -> None:
    """Apertus's xIELU scalars as metadata arrays and Llama 3's RoPE as `rope_freqs`
    (conversion/llama.py's LlamaModel.generate_extra_tensors)."""
    layers = hf_model.model.layers
    writer.add_xielu_alpha_p([float(layer.mlp.act_fn.alpha_p.detach()) for layer in layers])
    writer.add_xielu_alpha_n([float(layer.mlp.act_fn.alpha_n.detach()) for layer in layers])
    writer.add_xielu_beta([float(layer.mlp.act_fn.beta.detach()) for layer in layers])
    writer.add_xielu_eps([float(layer.mlp.act_fn.eps.detach()) for layer in layers])
    rope, dim = hf_model.config.rope_parameters, hf_model.config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    factors = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def write_classic_gguf(path, arch: str, hf_model, qtype=gguf.GGMLQuantizationType.F32, fuse_qkv=False):
    """`hf_model` as llama.cpp's converter writes it; 2-D weights other than the embedding as
    `qtype`."""
    arch = ARCH.get(arch, arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _metadata(writer, arch, hf_model.config)
    if arch == "apertus":
        _apertus_extras(writer, hf_model)
    for name, data in _tensors(arch, hf_model, fuse_qkv):
        if qtype != gguf.GGMLQuantizationType.F32 and data.ndim == 2 and "embd" not in name and "norm" not in name:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _distinct_xielu(hf) -> None:
    """Each Apertus layer's xIELU scalars its own (HF initializes them all alike)."""
    if type(hf).__name__ != "ApertusForCausalLM":
        return
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.mlp.act_fn.beta.fill_(0.3 + 0.2 * i)
            layer.mlp.act_fn.eps.fill_(-0.05 * (i + 1))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_classic_gguf_equals_the_hf_run(arch, hf_pair, check_hf, prompts, tmp_path):
    hf, ours_hf, _ = hf_pair(CONFIGS[arch](), prepare=_distinct_xielu)
    path = write_classic_gguf(tmp_path / f"{arch}.gguf", arch, hf)
    config, model = _load(path, tmp_path)
    assert type(model) is type(ours_hf)
    assert config.num_hidden_layers == 4 and config.vocab_size == VOCAB
    assert config.intermediate_size == hf.config.intermediate_size
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_classic_q8_0_gguf_keeps_projections_as_blocks(arch, hf_pair, tmp_path):
    hf, _, _ = hf_pair(CONFIGS[arch]())
    path = write_classic_gguf(tmp_path / f"{arch}-q8.gguf", arch, hf, gguf.GGMLQuantizationType.Q8_0)
    _, model = _load(path, tmp_path, keep_quantized=True)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.dtype == torch.uint8 and attn.k_proj.weight.quant.format.name == "q8_0"
    assert_greedy_in_hf_top5(hf, model)


def test_phi2_gguf_with_one_qkv_tensor_splits_it(hf_pair, check_hf, prompts, tmp_path):
    """The original phi-2 checkpoints' fused Wqkv, written as one `attn_qkv`: split into q / k / v."""
    hf, _, _ = hf_pair(CONFIGS["phi2"]())
    path = write_classic_gguf(tmp_path / "phi2-qkv.gguf", "phi2", hf, fuse_qkv=True)
    _, model = _load(path, tmp_path)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
