"""More dense families from GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them
(each converter's metadata keys, gguf-py's tensor names, its tensor changes): Jais 2
("jais2"), EXAONE 4.5's text decoder ("exaone4"), Youtu ("deepseek2" without experts), BitNet
b1.58 ("bitnet"). Our GGUF run equals the HF run in float32; Q8_0 projections kept as blocks
give greedy tokens in HF's top 5.
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
    # EXAONE 4.5's text decoder (hybrid: sliding layers with RoPE, a global one without), with one
    # multi-token-prediction block counted in block_count (conversion/exaone.py's Exaone4_5_TextModel)
    "exaone4_5": lambda: transformers.Exaone4_5_Config(
        text_config=dict(_COMMON, model_type="exaone4", sliding_window=4,
                         layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=1,
                           out_hidden_size=64, fullatt_block_indexes=[0],
                           rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2),
    # BitNet as llama.cpp runs it (SiLU-gated MLP, no activation quantization, tied: no `output`), the projections
    # ternary times one scale each (`_ternary_times_mean`: what the converter's weight_quant keeps)
    "bitnet": lambda: transformers.BitNetConfig(**{k: v for k, v in _COMMON.items() if k != "head_dim"},
                                                hidden_act="silu", tie_word_embeddings=True),
}
PREPARE = {"bitnet": lambda hf: _ternary_times_mean(hf)}
ARCH = {"exaone4_5": "exaone4"}  # test case -> GGUF architecture
HF_CLASS = {"exaone4_5": transformers.Exaone4_5_ForConditionalGeneration}
GGUF_CLASS = {"exaone4_5": "Exaone4ForCausalLM"}  # (the file holds the text decoder alone)
MTP_BLOCKS = {"exaone4_5": 1}


@torch.no_grad()
def _ternary_times_mean(hf) -> None:
    """Each BitNet projection `sign(w) * mean|w|`: ternary values ({-1, 1} here) times one scale,
    which conversion/bitnet.py's weight_quant maps onto itself."""
    for name, p in hf.named_parameters():
        if name.endswith("_proj.weight"):
            p.copy_(torch.where(p >= 0, 1.0, -1.0) * p.abs().mean())


def _metadata(writer: gguf.GGUFWriter, arch: str, c, mtp: int = 0) -> None:
    """The keys each family's converter class writes (set_gguf_parameters)."""
    c = c.get_text_config()
    writer.add_context_length(c.max_position_embeddings)  # (conversion/base.py's TextModel)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers + mtp)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch == "bitnet":  # conversion/bitnet.py
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(1.0)
    if arch == "jais2":  # conversion/jais.py's Jais2Model
        writer.add_layer_norm_eps(c.layer_norm_eps)
        writer.add_rope_dimension_count(c.head_dim)
    if arch == "exaone4":  # conversion/exaone.py's Exaone4Model (and 4.5's MTP count)
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_vocab_size(c.vocab_size)
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        if mtp:
            writer.add_nextn_predict_layers(mtp)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensors(arch: str, hf_model, mtp: int = 0):
    """`(gguf-py's name of the HF tensor, float32 data)` as the converter writes them (a
    multimodal checkpoint's text decoder only; `mtp` multi-token-prediction blocks after the
    layers: copies of the first layer, and the converter's nextn tensors)."""
    c = hf_model.config
    n = c.get_text_config().num_hidden_layers
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n + mtp)
    tied = getattr(c, "tie_word_embeddings", False)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and tied or hf_name.startswith("model.visual."):
            continue
        hf_name = hf_name.replace("model.language_model.", "model.")
        # (BitNet: the converter maps the sub-norms by the original checkpoints' names)
        hf_name = hf_name.replace(".attn_sub_norm.", ".inner_attn_ln.").replace(".ffn_sub_norm.", ".ffn_layernorm.")
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.detach().numpy().astype(np.float32)
        yield f"{name_map.get_name(base)}.{suffix}", data
        for k in range(mtp):
            if hf_name.startswith("model.layers.0."):
                yield f"{name_map.get_name(base.replace('layers.0.', f'layers.{n + k}.'))}.{suffix}", data
    h = c.get_text_config().hidden_size
    for k in range(mtp):
        yield f"blk.{n + k}.nextn.eh_proj.weight", np.ones((h, 2 * h), np.float32)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            yield f"blk.{n + k}.nextn.{norm}.weight", np.ones(h, np.float32)


def write_gguf(path, case: str, hf_model, qtype=gguf.GGMLQuantizationType.F32):
    """`hf_model` as llama.cpp's converter writes it; 2-D weights other than the embedding as
    `qtype`."""
    arch = ARCH.get(case, case)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    mtp = MTP_BLOCKS.get(case, 0)
    _metadata(writer, arch, hf_model.config, mtp)
    for name, data in _tensors(arch, hf_model, mtp):
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
    hf, ours_hf, _ = hf_pair(CONFIGS[case](), hf_class=HF_CLASS.get(case), prepare=PREPARE.get(case))
    path = write_gguf(tmp_path / f"{case}.gguf", case, hf)
    config, model = _load(path, tmp_path)
    assert type(model).__name__ == GGUF_CLASS.get(case, type(ours_hf).__name__)
    assert config.num_hidden_layers == 4 and config.vocab_size == VOCAB
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_q8_0_gguf_keeps_projections_as_blocks(case, hf_pair, tmp_path):
    hf, _, _ = hf_pair(CONFIGS[case](), hf_class=HF_CLASS.get(case), prepare=PREPARE.get(case))
    path = write_gguf(tmp_path / f"{case}-q8.gguf", case, hf, gguf.GGMLQuantizationType.Q8_0)
    _, model = _load(path, tmp_path, keep_quantized=True)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.dtype == torch.uint8 and attn.k_proj.weight.quant.format.name == "q8_0"
    assert_greedy_in_hf_top5(hf, model)


def _youtu_meta(c):
    """conversion/deepseek.py's keys for Youtu: no expert count, every block a leading dense one."""
    def meta(w):
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count_kv(1)  # MLA as MQA
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_leading_dense_block_count(c.num_hidden_layers)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_q_lora_rank(c.q_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_expert_shared_count(0)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
    return meta


def test_youtu_deepseek2_gguf_without_experts_is_youtu(hf_pair, check_hf, prompts, tmp_path):
    """A "deepseek2" file without experts (the converter's Youtu) loads as Youtu: latent
    attention, dense MLPs, the tied head (no `output` tensor); equal to the HF run."""
    from test_gguf_families import _gguf_tensors, _write

    config = transformers.YoutuConfig(**{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=32,
                                      qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    hf, ours_hf, _ = hf_pair(config)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = _write(tmp_path / "youtu.gguf", "deepseek2", config, _gguf_tensors("deepseek2", config, state),
                  _youtu_meta(config))
    loaded, model = _load(path, tmp_path)
    assert type(model) is type(ours_hf) and loaded.tie_word_embeddings
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
