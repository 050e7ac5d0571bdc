"""GGUF files of Falcon (llama.cpp architecture "falcon"), as llama.cpp's convert_hf_to_gguf.py
writes them (conversion/falcon.py's FalconModel): the HF config they describe and their tensors
under HF names (`models.gguf_loader` delegates the architecture here: Falcon's names are
`transformer.*`).

Metadata: `embedding_length`, `block_count`, `attention.head_count`, `attention.head_count_kv`,
`attention.layer_norm_epsilon`; `context_length` is the converter's fixed 2048 and
`feed_forward_length` its 4 x hidden (the width is read from `ffn_up` here); no RoPE base (10000,
as llama.cpp) and no block kind: llama.cpp runs every Falcon block in parallel, on
`attn_norm_2` / `attn_norm` (40B / 180B: HF's `ln_attn` / `ln_mlp`, `new_decoder_architecture`)
or on `attn_norm` alone (7B: one KV head, `multi_query` and `parallel_attn`; with more KV heads
the grouped layout on one LayerNorm, `num_ln_in_parallel_attn` 1), and so does the config here.
Tensors: `attn_qkv` rearranged by the converter ("jploski" layout) as every query head, then
every key head, then every value head; put back in HF's layout here (per KV group its queries,
key and value), kept blocks' rows moved whole; biases where the checkpoint has them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_families import common_config_fields
from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("falcon",)
_TOP = {"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f", "output": "lm_head"}
_BLOCK = {"attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
          "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a falcon GGUF."""
    req, name = header.require_arch_key, header.path.name
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    heads = int(req("attention.head_count"))
    kv = int(header.arch_key("attention.head_count_kv") or 1)
    up = header.tensor("blk.0.ffn_up.weight")
    if up is None:
        raise ValueError(f"{name}: falcon needs blk.0.ffn_up")
    two_norms = "blk.0.attn_norm_2.weight" in names
    fields = common_config_fields(header, names, vocab, layer_norm=True)
    cfg: dict[str, Any] = {
        "model_type": "falcon",
        "architectures": ["FalconForCausalLM"],
        "hidden_size": int(req("embedding_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "ffn_hidden_size": int(up.shape[0]),
        "layer_norm_epsilon": fields.pop("layer_norm_eps"),
        "new_decoder_architecture": two_norms or kv > 1,
        "num_ln_in_parallel_attn": 2 if two_norms else 1,
        "multi_query": kv == 1,
        "parallel_attn": True,
        "alibi": False,
        "bias": "blk.0.attn_qkv.bias" in names,
        "rope_theta": float(header.arch_key("rope.freq_base", 10000.0)),
        **fields,
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{name}: cannot tell the vocabulary size")
    return cfg


def hf_name(gguf_name: str, two_norms: bool) -> str | None:
    """The HF name of GGUF tensor `gguf_name`, or None if not mapped."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    leaf = parts[2]
    # (40B: gguf-py names ln_mlp attn_norm and ln_attn attn_norm_2; llama.cpp's MLP reads attn_norm)
    mapped = _BLOCK.get(leaf) or {"attn_norm": "ln_mlp" if two_norms else "input_layernorm",
                                  "attn_norm_2": "ln_attn" if two_norms else None}.get(leaf)
    return None if mapped is None else f"transformer.h.{int(parts[1])}.{mapped}.{suffix}"


def hf_qkv_rows(heads: int, kv: int, head_dim: int) -> torch.Tensor:
    """For each row of HF's fused q/k/v (per KV group: its queries, key, value), its row in the
    converter's layout (every query head, every key head, every value head)."""
    group = heads // kv
    q = torch.arange(heads * head_dim).view(kv, group * head_dim)  # [Hkv, g D]
    k = (heads * head_dim + torch.arange(kv * head_dim)).view(kv, head_dim)  # [Hkv, D]
    v = ((heads + kv) * head_dim + torch.arange(kv * head_dim)).view(kv, head_dim)  # [Hkv, D]
    return torch.cat((q, k, v), dim=1).reshape(-1)  # [(Hq + 2 Hkv) D]


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`); `attn_qkv`'s rows in HF's order."""
    two_norms = any(t.name.endswith(".attn_norm_2.weight") for t in header.tensors)
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        mapped = hf_name(info.name, two_norms)
        if mapped is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture 'falcon'")
        names[info.name] = mapped
    heads, kv = int(config.num_attention_heads), int(config.num_kv_heads if config.new_decoder_architecture else 1)
    order = hf_qkv_rows(heads, kv, config.hidden_size // heads)
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        quantized = _read_quantized(blob, info) if keep_quantized else None
        tensor = quantized.data if quantized is not None else _read_tensor_f32(blob, info)
        if ".attn_qkv." in info.name:
            tensor = tensor[order].contiguous()  # [(Hq + 2 Hkv) D, ...]: whole rows (of blocks)
        if quantized is not None:
            quantized.data = tensor
            tensor = quantized
        yield names[info.name], tensor
