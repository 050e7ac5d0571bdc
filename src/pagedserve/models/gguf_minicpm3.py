"""GGUF files of MiniCPM3 (llama.cpp architecture "minicpm3"), as llama.cpp's
convert_hf_to_gguf.py writes them (conversion/minicpm.py's MiniCPM3Model): the HF config they
describe and their tensors under HF names (`models.gguf_loader` delegates the architecture here).

Metadata: the sizes, `attention.q_lora_rank` (absent: a dense q_proj), `attention.kv_lora_rank`,
`attention.key_length` (qk_nope + qk_rope) and `rope.dimension_count` (qk_rope). The converter
writes no RoPE base, value width nor MiniCPM multipliers: llama.cpp's graph fixes them
(src/models/minicpm3.cpp: scale_emb 12, scale_depth 1.4, dim_model_base 256; the value width
hidden / heads; the base 10000), and so does the config here. LongRoPE's factors come as the
`rope_factors_long` / `rope_factors_short` tensors (folded into the config, from the file's
context length as the original one: llama.cpp's n_ctx_orig). Tensors: DeepSeek V2's MLA names
(`attn_q_a`, `attn_q_a_norm`, `attn_q_b` or `attn_q`, `attn_kv_a_mqa`, `attn_kv_a_norm`,
`attn_kv_b`, `attn_output`), Llama's norms and MLP; Q/K rows not permuted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedserve.models.gguf_families import common_config_fields, hf_name
from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("minicpm3",)
# llama.cpp's fixed MiniCPM3 constants (src/models/minicpm3.cpp)
SCALE_EMB, SCALE_DEPTH, DIM_MODEL_BASE = 12.0, 1.4, 256
_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a minicpm3 GGUF."""
    req = header.require_arch_key
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    rope = int(req("rope.dimension_count"))
    q_lora = header.arch_key("attention.q_lora_rank")
    cfg: dict[str, Any] = {
        "model_type": "minicpm3",
        "architectures": ["MiniCPM3ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.arch_key("attention.head_count_kv", heads)),
        **common_config_fields(header, names, vocab),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(req("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(req("attention.key_length")) - rope,
        "v_head_dim": int(header.arch_key("attention.value_length") or hidden // heads),
        "scale_emb": SCALE_EMB, "scale_depth": SCALE_DEPTH, "dim_model_base": DIM_MODEL_BASE,
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(header.arch_key("rope.freq_base", 10000.0))}
    if any(n in names for n in _FACTORS):
        if not all(n in names for n in _FACTORS):
            raise ValueError(f"{header.path.name}: rope_factors_long without rope_factors_short (or the reverse)")
        blob = np.memmap(header.path, dtype=np.uint8, mode="r")
        long, short = (_read_tensor_f32(blob, header.tensor(n)).reshape(-1).tolist() for n in _FACTORS)
        params.update(rope_type="longrope", long_factor=long, short_factor=short,
                      original_max_position_embeddings=cfg["max_position_embeddings"])
    cfg["rope_parameters"] = params
    return cfg


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`)."""
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        if info.name in _FACTORS or info.name == "rope_freqs.weight":
            continue
        name = hf_name("deepseek2", info.name)  # (DeepSeek V2's MLA names, no experts here)
        if name is None or ".kv_b_proj." in name and not name.endswith(".weight"):
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture 'minicpm3'")
        names[info.name] = name
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        if info.name in names:
            quantized = _read_quantized(blob, info) if keep_quantized else None
            yield names[info.name], quantized if quantized is not None else _read_tensor_f32(blob, info)
