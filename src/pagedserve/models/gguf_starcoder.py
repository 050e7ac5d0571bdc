"""GGUF files of GPT-BigCode (StarCoder 1, SantaCoder: llama.cpp architecture "starcoder"), as
llama.cpp's convert_hf_to_gguf.py writes them (conversion/starcoder.py's StarCoderModel): the HF
config they describe and their tensors under HF names (`models.gguf_loader` delegates the
architecture here: its names are GPT-2's `transformer.*`, not Llama's `model.*`).

Metadata: `context_length` (n_positions), `embedding_length`, `feed_forward_length` (the
converter writes 4 x n_embd whatever `n_inner` is: the width is read from `ffn_up` here),
`block_count`, `attention.head_count`, `attention.head_count_kv` (always 1: multi-query),
`attention.layer_norm_epsilon`. Not stored, HF's defaults kept: the gelu (tanh) activation, the
head_dim ** -0.5 scale. Multi-query or not is read from `attn_qkv`'s rows (H + 2 D, or 3 H).
Tensors: `token_embd`, `position_embd`, `output_norm`, `output` (absent: tied), per block
`attn_norm`, `attn_qkv`, `attn_output`, `ffn_norm`, `ffn_up`, `ffn_down`, each with its bias;
nothing permuted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedserve.models.gguf_families import common_config_fields
from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("starcoder",)
_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
        "output": "lm_head"}
_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
          "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a starcoder GGUF."""
    req, name = header.require_arch_key, header.path.name
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    qkv, up = header.tensor("blk.0.attn_qkv.weight"), header.tensor("blk.0.ffn_up.weight")
    if qkv is None or up is None:
        raise ValueError(f"{name}: starcoder needs blk.0.attn_qkv and blk.0.ffn_up")
    d = hidden // heads
    if qkv.shape[0] not in (hidden + 2 * d, 3 * hidden):
        raise ValueError(f"{name}: attn_qkv has {qkv.shape[0]} rows, neither {hidden + 2 * d} (multi-query) "
                         f"nor {3 * hidden}")
    fields = common_config_fields(header, names, vocab, layer_norm=True)
    eps = fields.pop("layer_norm_eps")
    positions = fields.pop("max_position_embeddings")
    cfg: dict[str, Any] = {
        "model_type": "gpt_bigcode",
        "architectures": ["GPTBigCodeForCausalLM"],
        "n_embd": hidden,
        "n_layer": int(req("block_count")),
        "n_head": heads,
        "n_positions": positions,
        "n_inner": int(up.shape[0]),
        "layer_norm_epsilon": eps,
        "multi_query": qkv.shape[0] == hidden + 2 * d,
        **fields,
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{name}: cannot tell the vocabulary size")
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """The HF name of GGUF tensor `gguf_name`, or None if not mapped."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"transformer.h.{int(parts[1])}.{_BLOCK[parts[2]]}.{suffix}"
    return None


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`)."""
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        mapped = hf_name(info.name)
        if mapped is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture 'starcoder'")
        names[info.name] = mapped
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        quantized = _read_quantized(blob, info) if keep_quantized else None
        yield names[info.name], quantized if quantized is not None else _read_tensor_f32(blob, info)
