"""GGUF files of Gemma 4's text decoder (llama.cpp architecture "gemma4"), as llama.cpp's
conversion/gemma.py (`Gemma4Model`) writes them: the HF config they describe and their tensors
under HF names (`models.gguf_loader` delegates "gemma4" here).

Metadata: the full layers' head size in `attention.key_length` and the sliding ones' in
`attention.key_length_swa`; `attention.head_count_kv` one value, or one per layer when the full
layers have their own (`num_global_key_value_heads`); `attention.sliding_window_pattern` a flag
per layer; `attention.shared_kv_layers`; `embedding_length_per_layer_input` (PLE);
`feed_forward_length` per layer when the shared layers' MLPs are double-wide; the rope bases of
both types (`rope.freq_base`, `rope.freq_base_swa`). Not stored, read back from the tensors:
V = K (`attention_k_eq_v`: the full layers have no `attn_v`), the full layers' proportional RoPE
(`rope_freqs`: factor 1 on the rotated frequencies, 1e30 on the others: its share is
`partial_rotary_factor`), the per-layer vocabulary (`per_layer_token_embd`'s rows).
Tensors: the norms as stored (Gemma 4's scale `w`, no `1 + w` shift), the experts fused
(`ffn_gate_up_exps` `[E, 2I, H]`, split here into gate / up rows, quantized blocks kept), the
router's input scale (`ffn_gate_inp.scale`) and per-expert scale (`ffn_down_exps.scale`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("gemma4",)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "ffn_down_exps": "experts.down_proj",  # (llama.cpp's merged name: layers.moe maps it)
}
# tensors named other than `.weight` / `.bias`, and scalars
_SPECIAL = {("layer_output_scale", "weight"): "layer_scalar", ("ffn_gate_inp", "scale"): "router.scale",
            ("ffn_down_exps", "scale"): "router.per_expert_scale"}
_SKIPPED = {"rope_freqs.weight"}
SLIDING, FULL = "sliding_attention", "full_attention"


def _req(header, key: str) -> Any:
    return header.require_arch_key(key)


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`: a `Gemma4TextConfig`) of a gemma4 GGUF."""
    from pagedserve.models.gguf_families import common_config_fields

    names = {t.name for t in header.tensors}
    layers = int(_req(header, "block_count"))
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    pattern = header.arch_key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"{header.path.name}: gemma4 needs attention.sliding_window_pattern, one flag a layer")
    types = [SLIDING if swa else FULL for swa in pattern]
    kv = header.arch_key("attention.head_count_kv")
    kv_list = kv if isinstance(kv, list) else [kv] * layers
    kv_swa = {int(k) for k, t in zip(kv_list, types) if t == SLIDING} or {int(kv_list[0])}
    kv_full = {int(k) for k, t in zip(kv_list, types) if t == FULL}
    if len(kv_swa) != 1 or len(kv_full) > 1:
        raise ValueError(f"{header.path.name}: attention.head_count_kv {kv} differs within a layer type")
    shared = int(header.arch_key("attention.shared_kv_layers") or 0)
    first_shared = layers - shared
    ff = header.arch_key("feed_forward_length")
    ff_list = [int(f) for f in ff] if isinstance(ff, list) else [int(ff)] * layers
    double = any(f != ff_list[0] for f in ff_list)
    if double and (any(f != ff_list[0] for f in ff_list[:first_shared])
                   or any(f != 2 * ff_list[0] for f in ff_list[first_shared:])):
        raise ValueError(f"{header.path.name}: feed_forward_length {ff} is not one width, doubled on "
                         "the KV-sharing layers (use_double_wide_mlp)")
    full_layer = next((i for i, t in enumerate(types[:first_shared]) if t == FULL), None)
    k_eq_v = full_layer is not None and f"blk.{full_layer}.attn_v.weight" not in names
    head_full = int(_req(header, "attention.key_length"))
    head_swa = int(header.arch_key("attention.key_length_swa") or head_full)
    full_rope: dict[str, Any] = {"rope_type": "proportional", "rope_theta": float(_req(header, "rope.freq_base")),
                                 "partial_rotary_factor": _proportional_share(header, head_full)}
    cfg: dict[str, Any] = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": int(_req(header, "embedding_length")),
        "intermediate_size": ff_list[0],
        "use_double_wide_mlp": double,
        "num_hidden_layers": layers,
        "num_attention_heads": int(_req(header, "attention.head_count")),
        "num_key_value_heads": kv_swa.pop(),
        "head_dim": head_swa,
        "global_head_dim": head_full,
        "attention_k_eq_v": k_eq_v,
        "layer_types": types,
        "sliding_window": int(_req(header, "attention.sliding_window")),
        "num_kv_shared_layers": shared,
        "final_logit_softcapping": header.arch_key("final_logit_softcapping"),
        "rope_parameters": {SLIDING: {"rope_type": "default",
                                      "rope_theta": float(header.arch_key("rope.freq_base_swa") or 10000.0)},
                            FULL: full_rope},
        "attention_bias": False,
        **common_config_fields(header, names, vocab),
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    if kv_full:
        full = kv_full.pop()
        if full != cfg["num_key_value_heads"]:
            if not k_eq_v:  # (HF applies num_global_key_value_heads with attention_k_eq_v only)
                raise ValueError(f"{header.path.name}: full layers of {full} KV heads without V = K")
            cfg["num_global_key_value_heads"] = full
    ple = int(header.arch_key("embedding_length_per_layer_input") or 0)
    cfg["hidden_size_per_layer_input"] = ple
    if ple:
        cfg["vocab_size_per_layer_input"] = int(header.tensor("per_layer_token_embd.weight").shape[0])
    experts = header.arch_key("expert_count")
    cfg["enable_moe_block"] = bool(experts)
    if experts:
        cfg.update(num_experts=int(experts), top_k_experts=int(_req(header, "expert_used_count")),
                   moe_intermediate_size=int(_req(header, "expert_feed_forward_length")))
    return cfg


def _proportional_share(header, head_dim: int) -> float:
    """The full layers' `partial_rotary_factor`: the share of `rope_freqs` factors that are 1
    (the converter's 1e30 freezes the others), 1.0 without the tensor."""
    info = header.tensor("rope_freqs.weight")
    if info is None:
        return 1.0
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    factors = _read_tensor_f32(blob, info).reshape(-1)  # [D / 2]
    rotated = int((factors == 1.0).sum())
    if factors.numel() != head_dim // 2 or bool((factors[:rotated] != 1.0).any()) \
            or bool((factors[rotated:] < 1e29).any()):
        raise ValueError(f"{header.path.name}: rope_freqs.weight is not proportional RoPE's factors")
    return 2 * rotated / head_dim


def hf_name(gguf_name: str) -> str | None:
    """The HF (or stacked-expert) name of GGUF tensor `gguf_name`, or None if not mapped;
    `ffn_gate_up_exps` -> `...experts.gate_up_proj` (split by `iter_weights`)."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot:
        return None
    if stem in _TOP and suffix == "weight":
        return f"{_TOP[stem]}.weight"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    prefix, leaf = f"model.layers.{int(parts[1])}.", parts[2]
    if (leaf, suffix) in _SPECIAL:
        return prefix + _SPECIAL[leaf, suffix]
    if leaf == "ffn_gate_up_exps" and suffix == "weight":
        return prefix + "experts.gate_up_proj"
    mapped = _BLOCK.get(leaf)
    return None if mapped is None or suffix not in ("weight", "bias") else f"{prefix}{mapped}.{suffix}"


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`); the fused experts as gate / up."""
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        if info.name in _SKIPPED:
            continue
        name = hf_name(info.name)
        if name is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture gemma4")
        names[info.name] = name
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = names.get(info.name)
        if name is None:
            continue
        quantized = _read_quantized(blob, info) if keep_quantized else None
        tensor = quantized if quantized is not None else _read_tensor_f32(blob, info)
        if name.endswith(".layer_scalar"):
            tensor = tensor.reshape(1)
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            stem = name[: -len("gate_up_proj")]
            gate, up = _split_rows(tensor)
            yield stem + "gate_proj.weight", gate
            yield stem + "up_proj.weight", up
            continue
        yield name, tensor


def _split_rows(tensor):
    """`[E, 2I, H]` (values, or a `QuantizedTensor`'s rows of blocks) -> its two `[E, I, H]` halves."""
    from pagedserve.layers.quantization import QuantizedTensor

    if not isinstance(tensor, QuantizedTensor):
        inter = tensor.shape[1] // 2
        return tensor[:, :inter].contiguous(), tensor[:, inter:].contiguous()
    e, rows, cols = tensor.shape
    inter = rows // 2
    return tuple(QuantizedTensor(part.contiguous(), tensor.format, (e, inter, cols), tensor.ggml_type)
                 for part in (tensor.data[:, :inter], tensor.data[:, inter:]))
