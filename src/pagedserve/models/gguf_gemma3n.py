"""GGUF files of Gemma 3n's text decoder (llama.cpp architecture "gemma3n"), as llama.cpp's
conversion/gemma.py (`Gemma3NModel`) writes them: the HF config they describe and their tensors
under HF names (`models.gguf_loader` delegates "gemma3n" here).

Metadata: `altup.num_inputs`, `altup.active_idx`, `embedding_length_per_layer_input` (PLE),
`attention.shared_kv_layers`, `attention.sliding_window_pattern` (a flag per layer), both rope
bases (`rope.freq_base` full, `rope.freq_base_swa` sliding), `feed_forward_length` (one, or one
per layer), and `activation_sparsity_scale`: per layer the converter's `icdf(sparsity)` in
float32 (-inf for a dense layer), read back as the sparsity whose float32 icdf it is (checked
to give the very multiplier: ValueError otherwise). Read from the tensors: Laurel's rank
(`laurel_l`'s rows), the per-layer vocabulary (`per_layer_token_embd`'s rows: the converter pads
it with zero rows to the whole vocabulary, so ids past the real table read zeros there, as
llama.cpp does; HF reads row 0). Not stored: `altup_correct_scale` (the converter writes the
scale and llama.cpp always applies it: True). The norms are stored as is (Gemma 3n's `w`, no
`1 + w` shift); `altup_proj` / `altup_unembd_proj` stack the `N - 1` stream projections
`[N - 1, H, H]` and are split back here (quantized blocks kept).

NOTE: llama.cpp's own graph deviates from HF (and from us) where the file says otherwise: it
fixes the KV-producing layers at 20 and the sparse layers at the first 10 whatever the metadata,
and takes the sample standard deviation (n - 1) in the gaussian top-k; we follow HF, reading
the metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_gemma4 import _BLOCK as _GEMMA4_BLOCK
from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("gemma3n",)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm"}
_STACKED = {"altup_proj": "model.altup_projections", "altup_unembd_proj": "model.altup_unembed_projections"}
_BLOCK = {
    **{k: v for k, v in _GEMMA4_BLOCK.items() if not k.startswith(("ffn_gate_inp", "ffn_down_exps", "post_ffw_norm_",
                                                                   "pre_ffw_norm_"))},
    "altup_correct_coef": "altup.correction_coefs",
    "altup_correct_scale": "altup.correct_output_scale",
    "altup_predict_coef": "altup.prediction_coefs",
    "altup_router": "altup.modality_router",
    "altup_router_norm": "altup.router_norm",
    "laurel_l": "laurel.linear_left",
    "laurel_r": "laurel.linear_right",
    "laurel_post_norm": "laurel.post_laurel_norm",
}
_BARE = ("altup.correct_output_scale",)  # HF parameters without a `.weight` suffix
SLIDING, FULL = "sliding_attention", "full_attention"


def _req(header, key: str) -> Any:
    return header.require_arch_key(key)


def sparsity_of(multiplier: float, where: str) -> float:
    """The sparsity whose float32 normal icdf (HF's, `gaussian_std_multiplier`) is `multiplier`
    (float32), 0.0 for -inf (a dense layer). ValueError when none gives it exactly."""
    from pagedserve.models.gemma3n import gaussian_std_multiplier

    if multiplier == float("-inf"):
        return 0.0
    cdf = torch.distributions.normal.Normal(0, 1).cdf(torch.tensor(multiplier, dtype=torch.float64))
    p = float(str(np.float32(cdf.item())))  # the shortest decimal of that float32 (0.95)
    if not 0.0 < p < 1.0 or float(gaussian_std_multiplier(p)) != float(np.float32(multiplier)):
        raise ValueError(f"{where}: activation_sparsity_scale {multiplier} is no float32 normal quantile "
                         "of a sparsity in (0, 1)")
    return p


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`: a `Gemma3nTextConfig`) of a gemma3n GGUF."""
    from pagedserve.models.gguf_families import common_config_fields

    where = header.path.name
    names = {t.name for t in header.tensors}
    layers = int(_req(header, "block_count"))
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    pattern = header.arch_key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"{where}: gemma3n needs attention.sliding_window_pattern, one flag a layer")
    kv = header.arch_key("attention.head_count_kv")
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise ValueError(f"{where}: attention.head_count_kv {kv} differs between layers")
        kv = kv[0]
    ff = header.arch_key("feed_forward_length")
    ff_list = [int(f) for f in ff] if isinstance(ff, list) else [int(ff)] * layers
    scales = header.arch_key("activation_sparsity_scale")
    scales = list(scales) if isinstance(scales, list) else [float("-inf")] * layers
    if len(scales) != layers or len(ff_list) != layers:
        raise ValueError(f"{where}: activation_sparsity_scale / feed_forward_length need one value a layer")
    laurel = header.tensor("blk.0.laurel_l.weight")
    ple_embd = header.tensor("per_layer_token_embd.weight")
    if laurel is None or ple_embd is None:
        raise ValueError(f"{where}: gemma3n needs blk.0.laurel_l.weight and per_layer_token_embd.weight")
    cfg: dict[str, Any] = {
        "model_type": "gemma3n_text",
        "architectures": ["Gemma3nForCausalLM"],
        "hidden_size": int(_req(header, "embedding_length")),
        "intermediate_size": ff_list,
        "num_hidden_layers": layers,
        "num_attention_heads": int(_req(header, "attention.head_count")),
        "num_key_value_heads": int(kv),
        "head_dim": int(_req(header, "attention.key_length")),
        "layer_types": [SLIDING if swa else FULL for swa in pattern],
        "sliding_window": int(_req(header, "attention.sliding_window")),
        "num_kv_shared_layers": int(header.arch_key("attention.shared_kv_layers") or 0),
        "final_logit_softcapping": header.arch_key("final_logit_softcapping"),
        "rope_parameters": {SLIDING: {"rope_type": "default",
                                      "rope_theta": float(header.arch_key("rope.freq_base_swa") or 10000.0)},
                            FULL: {"rope_type": "default", "rope_theta": float(_req(header, "rope.freq_base"))}},
        "attention_bias": False,
        "hidden_size_per_layer_input": int(_req(header, "embedding_length_per_layer_input")),
        "vocab_size_per_layer_input": int(ple_embd.shape[0]),
        "altup_num_inputs": int(_req(header, "altup.num_inputs")),
        "altup_active_idx": int(_req(header, "altup.active_idx")),
        "altup_correct_scale": True,
        "laurel_rank": int(laurel.shape[0]),
        "activation_sparsity_pattern": [sparsity_of(float(s), where) for s in scales],
        **common_config_fields(header, names, vocab),
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{where}: cannot tell the vocabulary size")
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """The HF name of GGUF tensor `gguf_name` (a stacked stream projection: its module list's
    name, split by `iter_weights`), or None if not mapped."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix != "weight":
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.weight"
    if stem in _STACKED:
        return _STACKED[stem]
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    mapped = _BLOCK.get(parts[2])
    if mapped is None:
        return None
    return f"model.layers.{int(parts[1])}.{mapped}" + ("" if mapped in _BARE else ".weight")


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`); the stacked stream projections as
    one `[H, H]` matrix each."""
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        name = hf_name(info.name)
        if name is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture gemma3n")
        names[info.name] = name
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = names[info.name]
        quantized = _read_quantized(blob, info) if keep_quantized else None
        tensor = quantized if quantized is not None else _read_tensor_f32(blob, info)
        if info.name.split(".")[0] in _STACKED:
            for k, part in enumerate(_split_first(tensor)):
                yield f"{name}.{k}.weight", part
            continue
        yield name, tensor


def _split_first(tensor) -> list:
    """`[K, R, C]` (values, or a `QuantizedTensor`'s blocks) -> its K `[R, C]` matrices."""
    from pagedserve.layers.quantization import QuantizedTensor

    if not isinstance(tensor, QuantizedTensor):
        return [t.contiguous() for t in tensor]
    k, rows, cols = tensor.shape
    return [QuantizedTensor(tensor.data[i].contiguous(), tensor.format, (rows, cols), tensor.ggml_type)
            for i in range(k)]
