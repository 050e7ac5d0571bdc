"""A GGUF header's metadata as the HF config a checkpoint of the same model would carry.

`build_gguf_config_dict(header)`: the `AutoConfig.for_model` kwargs (sizes, rope and its scaling,
MoE routing, the dense families' extras) from llama.cpp's metadata keys, for the architectures in
`SUPPORTED_ARCHITECTURES`. `models.gguf_loader` caches the result per file with the tokenizer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_families import ARCHITECTURES as FAMILY_ARCHITECTURES
from pagedserve.models.gguf_families import common_config_fields
from pagedserve.models.gguf_reader import GGUFHeader, _read_tensor_f32

SUPPORTED_ARCHITECTURES = (
    "gemma3", "llama", "qwen2", "qwen3",
    "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "glm4moe", "ernie4_5-moe",  # MoE (Mixtral: "llama")
    "phimoe", "minimax-m2",
    "phi3", "gemma2", "granite", "glm4", "smollm3", "olmo2", "seed_oss",  # dense families of issue 35
    "command-r", "cohere2",  # Cohere: Command R / R+, Command R7B / A
    "mistral3",  # Mistral 3's text decoder: Mistral Small 3.x, Ministral 3
    "lfm2", "lfm2moe",  # short convolutions and attention layers (and experts)
    "exaone4",
    "llama4",  # Llama 4's text decoder
) + FAMILY_ARCHITECTURES  # deepseek2, gpt-oss (models/gguf_families.py)
"""GGUF `general.architecture` values that `iter_gguf_weights` and `load_gguf_config` handle."""

_HF_MODEL_TYPE = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
                  "granitemoe": "granitemoe", "glm4moe": "glm4_moe", "ernie4_5-moe": "ernie4_5_moe"}
_HF_MODEL_TYPE.update({a: a for a in ("phi3", "gemma2", "granite", "glm4", "smollm3", "olmo2", "seed_oss",
                                        "phimoe", "cohere2", "exaone4")})
_HF_MODEL_TYPE["command-r"] = "cohere"
_HF_MODEL_TYPE["mistral3"] = "mistral"  # "ministral3" with a temperature scale (below)
_HF_MODEL_TYPE.update(lfm2="lfm2", lfm2moe="lfm2_moe", llama4="llama4_text")
_HF_MODEL_TYPE["minimax-m2"] = "minimax_m2"
_HF_ARCHITECTURE = {
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
}
# NOTE: llama.cpp fixes the top-k renormalization per architecture (its build_moe_ffn's norm_w),
# it stores no norm_topk_prob: Mixtral and Qwen3-MoE renormalize, Qwen2-MoE and OLMoE do not.
_MOE_RENORMALIZE = {"mixtral": True, "qwen3_moe": True, "qwen2_moe": False, "olmoe": False}


def _check_supported(header: GGUFHeader) -> None:
    if header.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {header.architecture!r} ({header.path.name}) is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _require(header: GGUFHeader, key: str) -> Any:
    return header.require_arch_key(key)


def build_gguf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) a GGUF header describes.

    Mirrors what transformers' GGUF loader reads (`GGUF_CONFIG_MAPPING`), plus what it misses:
    `head_dim` from `attention.key_length`, rope scaling (including Llama 3's `rope_freqs` tensor),
    Gemma 3's `query_pre_attn_scalar` for the 27B model, `attention_bias`, `architectures`.

    Raises:
        ValueError: unsupported architecture or missing/unsupported metadata.
    """
    _check_supported(header)
    arch = header.architecture
    if arch in FAMILY_ARCHITECTURES:  # deepseek2, gpt-oss: models/gguf_families.py
        from pagedserve.models.gguf_families import config_dict

        return config_dict(header)
    md = header.metadata
    tensor_names = {t.name for t in header.tensors}

    hidden = int(_require(header, "embedding_length"))
    n_heads = int(_require(header, "attention.head_count"))
    n_kv = header.arch_key("attention.head_count_kv", n_heads)
    layer_kv = None
    if isinstance(n_kv, list) and arch in ("lfm2", "lfm2moe"):  # 0 on the short-convolution layers
        layer_kv, n_kv = n_kv, max(n_kv)
    if isinstance(n_kv, list):  # per-layer counts (not used by our other architectures)
        raise ValueError(f"{header.path.name}: per-layer attention.head_count_kv is not supported")
    head_dim = header.arch_key("attention.key_length")
    if not head_dim and arch not in _PARTIAL_ROPE_ARCHS:  # there rope.dimension_count is the rotated part
        head_dim = header.arch_key("rope.dimension_count")
    head_dim = int(head_dim) if head_dim else hidden // n_heads

    model_type = _HF_MODEL_TYPE[arch]
    name = md.get("general.name")
    if arch == "llama" and isinstance(name, str) and "mistral" in name.lower():
        model_type = "mistral"  # llama.cpp writes Mistral models as "llama"
    if arch == "llama" and header.arch_key("expert_count"):
        model_type = "mixtral"  # llama.cpp writes Mixtral as "llama" with experts
    if arch == "granitemoe" and header.arch_key("expert_shared_feed_forward_length"):
        model_type = "granitemoeshared"  # llama.cpp writes both as "granitemoe"
    if arch == "mistral3" and header.arch_key("attention.temperature_scale") is not None:
        model_type = "ministral3"  # Llama 4's query temperature: Ministral 3
    if arch == "olmo2" and header.arch_key("attention.sliding_window"):
        model_type = "olmo3"  # llama.cpp writes OLMo 3 as "olmo2" with sliding windows

    # NOTE: the embedding's row count is what the weights need; the token list can be shorter.
    token_embd = header.tensor("token_embd.weight")
    vocab_size = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    vocab_size = vocab_size or md.get("tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [_HF_ARCHITECTURE[model_type]],
        "hidden_size": hidden,
        "intermediate_size": int(_require(header, "feed_forward_length")),
        "num_hidden_layers": int(_require(header, "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        **common_config_fields(header, tensor_names, vocab_size, layer_norm=arch in _COHERE_ARCHS),
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    if (unk := md.get("tokenizer.ggml.unknown_token_id")) is not None:
        cfg["unk_token_id"] = unk
    if (theta := header.arch_key("rope.freq_base")) is not None:
        cfg["rope_theta"] = float(theta)
    rope_scaling = (None if arch in ("phi3", "phimoe")  # (their LongRoPE: _phi3_longrope)
                    else _rope_scaling(header, head_dim, cfg.get("rope_theta", 10000.0)))
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if arch in _DENSE_FAMILY_CONFIG:
        _DENSE_FAMILY_CONFIG[arch](header, cfg)
    if arch in ("lfm2", "lfm2moe"):
        _lfm2_config(header, cfg, layer_kv)

    if model_type == "mistral":
        # NOTE: MistralConfig defaults to a 4096-token sliding window (v0.1); llama.cpp runs "llama"
        # GGUFs with full attention and stores no window, so neither do we.
        cfg["sliding_window"] = None
    if model_type in _MOE_RENORMALIZE:
        cfg.update(_moe_config(header, model_type, cfg))
    if arch == "granitemoe":
        _granite_config(header, cfg)
        cfg["num_local_experts"] = int(_require(header, "expert_count"))
        cfg["num_experts_per_tok"] = int(_require(header, "expert_used_count"))
        if model_type == "granitemoeshared":
            cfg["shared_intermediate_size"] = int(_require(header, "expert_shared_feed_forward_length"))
    if arch == "llama":
        cfg["attention_bias"] = any(n.endswith(".attn_q.bias") for n in tensor_names)
        cfg["mlp_bias"] = any(n.endswith(".ffn_up.bias") for n in tensor_names)
    if arch == "gemma3":
        if (window := header.arch_key("attention.sliding_window")) is not None:
            cfg["sliding_window"] = int(window)
        # NOTE: without this key llama.cpp (and HF's default) use 5 sliding layers then 1 full.
        pattern = header.arch_key("attention.sliding_window_pattern")
        if isinstance(pattern, int) and pattern > 0:
            cfg["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])
            ]
        elif isinstance(pattern, list):  # one flag per layer, True = sliding window
            cfg["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]
        if (swa_theta := header.arch_key("rope.freq_base_swa")) is not None:
            cfg["rope_local_base_freq"] = float(swa_theta)
        # NOTE: llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B model (62 layers)
        # which uses 1/sqrt(hidden/heads); HF states this as query_pre_attn_scalar.
        cfg["query_pre_attn_scalar"] = hidden // n_heads if cfg["num_hidden_layers"] == 62 else head_dim
    return cfg


def _moe_config(header: GGUFHeader, model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of the HF config (experts, routed per token, expert widths) from llama.cpp's
    `expert_*` keys."""
    experts = int(_require(header, "expert_count"))
    out: dict[str, Any] = {
        "num_local_experts" if model_type == "mixtral" else "num_experts": experts,
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "norm_topk_prob": _MOE_RENORMALIZE[model_type],
    }
    if model_type in ("qwen2_moe", "qwen3_moe"):
        width = header.arch_key("expert_feed_forward_length") or cfg["intermediate_size"]
        out["moe_intermediate_size"] = int(width)
        out["decoder_sparse_step"], out["mlp_only_layers"] = 1, []  # every layer has experts
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(_require(header, "expert_shared_feed_forward_length"))
        out["qkv_bias"] = any(t.name.endswith(".attn_q.bias") for t in header.tensors)
    if model_type == "olmoe" and (clip := header.arch_key("attention.clamp_kqv")) is not None:
        out["clip_qkv"] = float(clip)
    if model_type == "mixtral":
        out["sliding_window"] = None  # as Mistral's (llama.cpp runs it with full attention)
    return out
_PARTIAL_ROPE_ARCHS = ("phi3", "glm4", "glm4moe", "cohere2", "minimax-m2")
_COHERE_ARCHS = ("command-r", "cohere2")  # LayerNorm (attention.layer_norm_epsilon), not RMSNorm


def _partial_rotary(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """`partial_rotary_factor` from `rope.dimension_count` (the rotated part of each head)."""
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None:
        cfg["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]


def _phi3_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Phi-3: partial RoPE, LongRoPE (`_phi3_longrope`); `sliding_window` (0: none), kept as HF
    keeps it (NOTE: llama.cpp disables Phi-3's sliding window; HF applies it)."""
    _partial_rotary(header, cfg)
    _phi3_longrope(header, cfg)
    window = header.arch_key("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None


def _phi3_longrope(header: GGUFHeader, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """LongRoPE as llama.cpp's Phi-3 converters write it (Phi-3, Phi-3.5-MoE): the
    `rope_factors_long` / `rope_factors_short` tensors (-> `cfg["rope_scaling"]`, also returned;
    None without them) and `rope.scaling.original_context_length`."""
    if (original := header.arch_key("rope.scaling.original_context_length")) is not None:
        cfg["original_max_position_embeddings"] = int(original)
    long, short = header.tensor("rope_factors_long.weight"), header.tensor("rope_factors_short.weight")
    if long is None or short is None:
        return None
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    cfg["rope_scaling"] = {
        "rope_type": "longrope",
        "long_factor": _read_tensor_f32(blob, long).tolist(),
        "short_factor": _read_tensor_f32(blob, short).tolist(),
    }
    return cfg["rope_scaling"]


def _phimoe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Phi-3.5-MoE: the experts, q/k/v/o and LM head biases when the file has them, Phi-3's
    LongRoPE and sliding window (kept as HF keeps it; llama.cpp's phimoe runs none).

    NOTE: the file keeps neither `short_mscale` / `long_mscale` nor `router_jitter_noise`. Both
    mscales become the converter's `rope.scaling.attn_factor` (what llama.cpp scales cos/sin by;
    its default 1 without the key): HF's formula sqrt(1 + ln(max / original) / ln(original)),
    1.1902 for Phi-3.5-MoE-instruct, whose config says 1.2432 -- that GGUF differs from its HF
    folder there. The jitter eps is HF's default, 0.01 (Phi-3.5-MoE-instruct's)."""
    names = {t.name for t in header.tensors}
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        raise ValueError(f"{header.path.name}: phimoe rope.dimension_count {rope_dims} != head_dim "
                         f"{cfg['head_dim']} (partial RoPE is not Phi-3.5-MoE's)")
    cfg["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
    cfg["lm_head_bias"] = "output.bias" in names
    cfg["num_local_experts"] = int(_require(header, "expert_count"))
    cfg["num_experts_per_tok"] = int(_require(header, "expert_used_count"))
    if (scaling := _phi3_longrope(header, cfg)) is not None:
        mscale = float(header.arch_key("rope.scaling.attn_factor", 1.0))
        scaling.update(short_mscale=mscale, long_mscale=mscale,
                       original_max_position_embeddings=cfg.get("original_max_position_embeddings",
                                                                cfg["max_position_embeddings"]))
    window = header.arch_key("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None


def _gemma2_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Gemma 2: soft-capping values, the window of its every-other sliding layers, and the query
    scale llama.cpp uses (1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B's 46 layers)."""
    cfg["attn_logit_softcapping"] = header.arch_key("attn_logit_softcapping")
    cfg["final_logit_softcapping"] = header.arch_key("final_logit_softcapping")
    if (window := header.arch_key("attention.sliding_window")) is not None:
        cfg["sliding_window"] = int(window)
    n_heads = cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // n_heads if cfg["num_hidden_layers"] == 46
                                    else cfg["head_dim"])


def _granite_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Granite's four multipliers (llama.cpp names them scales)."""
    for key, name in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                      ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
        if (value := header.arch_key(key)) is not None:
            cfg[name] = float(value)


def _glm4_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """GLM-4: partial (interleaved) RoPE; q/k/v biases when the file has them."""
    _partial_rotary(header, cfg)
    cfg["attention_bias"] = any(t.name.endswith(".attn_q.bias") for t in header.tensors)


def _olmo2_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """OLMo 2; with `attention.sliding_window`, OLMo 3: its layer types from
    `attention.sliding_window_pattern` (HF's default without one: every fourth layer full) and
    RoPE per layer type as llama.cpp's converter writes it (the scaling and `rope.freq_base` the
    full layers', `rope.freq_base_swa` the sliding ones')."""
    cfg["attention_bias"] = any(t.name.endswith(".attn_q.bias") for t in header.tensors)
    window = header.arch_key("attention.sliding_window")
    if not window:
        return
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = _window_layer_types(header, n)
    cfg["sliding_window"] = int(window)
    theta = float(cfg.pop("rope_theta", 10000.0))
    full = {"rope_type": "default", "rope_theta": theta, **(cfg.pop("rope_scaling", None) or {})}
    swa = header.arch_key("rope.freq_base_swa")
    cfg["rope_parameters"] = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": float(swa) if swa else theta}}


def _window_layer_types(header: GGUFHeader, n: int, period: int = 4) -> list[str]:
    """Each layer's type from `attention.sliding_window_pattern`, as llama.cpp reads it: one flag
    per layer (True: sliding), or a period (every `period`-th layer full; 0: every layer
    sliding); `period` when the file has none."""
    pattern = header.arch_key("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"{header.path.name}: attention.sliding_window_pattern has {len(pattern)} flags "
                             f"for {n} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _exaone4_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """EXAONE 4.0: with `attention.sliding_window`, the layer types from its pattern (one flag per
    layer; HF's default without one: every fourth layer global); without, every layer global."""
    window = header.arch_key("attention.sliding_window")
    n = cfg["num_hidden_layers"]
    if not window:
        cfg["sliding_window"] = None
        cfg["layer_types"] = ["full_attention"] * n
        return
    cfg["layer_types"] = _window_layer_types(header, n)
    cfg["sliding_window"] = int(window)


def _seed_oss_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Seed-OSS: its three bias switches, from the tensors the file has."""
    names = [t.name for t in header.tensors]
    cfg["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
    cfg["attention_out_bias"] = any(n.endswith(".attn_output.bias") for n in names)
    cfg["mlp_bias"] = any(n.endswith(".ffn_up.bias") for n in names)


def _cohere_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Command-R ("command-r") and Cohere 2 ("cohere2"): `logit_scale` (llama.cpp: absent or 0,
    none), q/k/o biases and Command R+'s per-head q/k norms when the file has them; Cohere 2's
    window and layer types from `attention.sliding_window_pattern` (flags, or a period; llama.cpp's
    default without one: 4, every fourth layer full). llama.cpp rotates `rope.dimension_count`
    dimensions; HF's Cohere whole heads (head_dim = hidden / heads): another count is a
    ValueError, as an attention.key_length other than hidden / heads."""
    names = [t.name for t in header.tensors]
    name = header.path.name
    if cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise ValueError(f"{name}: attention.key_length {cfg['head_dim']} is not hidden / heads; "
                         "not supported (HF's Cohere)")
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        raise ValueError(f"{name}: rope.dimension_count {rope_dims} (partial RoPE) is not supported "
                         f"for {header.architecture}: HF's Cohere rotates whole heads ({cfg['head_dim']})")
    cfg["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
    scale = header.arch_key("logit_scale") if header.architecture == "command-r" else _require(header, "logit_scale")
    cfg["logit_scale"] = float(scale) if scale else 1.0
    if header.architecture == "command-r":
        cfg["use_qk_norm"] = any(n.endswith(".attn_q_norm.weight") for n in names)
        return
    n = cfg["num_hidden_layers"]
    cfg["sliding_window"] = int(_require(header, "attention.sliding_window"))
    cfg["layer_types"] = _window_layer_types(header, n)


def _smollm3_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """SmolLM3: llama.cpp fixes no RoPE on every fourth layer (as HF's default interval)."""
    cfg["no_rope_layer_interval"] = 4
    cfg["attention_bias"] = any(t.name.endswith(".attn_q.bias") for t in header.tensors)


def _mistral3_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Mistral 3's text decoder (llama.cpp's "mistral3", Llama's layout): YaRN's `mscale_all_dim`
    from `rope.scaling.yarn_log_multiplier` with `mscale` 1 (what llama.cpp assumes), and for
    Ministral 3 (`attention.temperature_scale`) HF's one rope dict carrying the temperature's
    beta, whose length is YaRN's original one (llama.cpp's floor scale: n_ctx_orig_yarn)."""
    scaling = cfg.get("rope_scaling")
    log_mul = header.arch_key("rope.scaling.yarn_log_multiplier")
    if scaling is not None and scaling["rope_type"] == "yarn" and log_mul is not None:
        scaling.update(mscale=1.0, mscale_all_dim=float(log_mul))
    beta = header.arch_key("attention.temperature_scale")
    if beta is None:
        return
    if scaling is None or "original_max_position_embeddings" not in scaling:
        raise ValueError(f"{header.path.name}: attention.temperature_scale needs "
                         "rope.scaling.original_context_length (its floor scale)")
    cfg["rope_parameters"] = {"rope_theta": float(cfg.pop("rope_theta", 10000.0)),
                              **cfg.pop("rope_scaling"), "llama_4_scaling_beta": float(beta)}


def _lfm2_config(header: GGUFHeader, cfg: dict[str, Any], layer_kv: list[int] | None) -> None:
    """LFM2 and LFM2-MoE: the layer types from the per-layer KV head counts (0: a short-
    convolution layer), the convolution's length and bias, the MLP width as written (LFM2's
    already adjusted), the RMS epsilon under HF's name; LFM2-MoE's experts and routing."""
    n = cfg["num_hidden_layers"]
    kv = layer_kv if layer_kv is not None else [cfg["num_key_value_heads"]] * n
    if len(kv) != n:
        raise ValueError(f"{header.path.name}: attention.head_count_kv has {len(kv)} entries for {n} layers")
    if header.arch_key("attention.sliding_window"):  # llama.cpp's SWA variant: no HF config says it
        raise ValueError(f"{header.path.name}: {header.architecture} attention.sliding_window is not supported")
    cfg["layer_types"] = ["conv" if k == 0 else "full_attention" for k in kv]
    cfg["conv_L_cache"] = int(_require(header, "shortconv.l_cache"))
    cfg["conv_bias"] = any(t.name.endswith(".shortconv.in_proj.bias") for t in header.tensors)
    cfg["norm_eps"] = cfg.pop("rms_norm_eps")
    if header.architecture == "lfm2":
        cfg["block_auto_adjust_ff_dim"] = False
        return
    # LFM2-MoE: llama.cpp always renormalizes the sigmoid top-k and reads the selection bias
    # (exp_probs_b) as required; dense layers below leading_dense_block_count
    if (gating := header.arch_key("expert_gating_func")) not in (None, 2):
        raise ValueError(f"{header.path.name}: lfm2moe expert_gating_func {gating} (only 2, sigmoid, is LFM2's)")
    cfg.update({
        "num_experts": int(_require(header, "expert_count")),
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "moe_intermediate_size": int(_require(header, "expert_feed_forward_length")),
        "num_dense_layers": int(header.arch_key("leading_dense_block_count") or 0),
        "use_expert_bias": any(t.name.endswith(".exp_probs_b.bias") for t in header.tensors),
        "norm_topk_prob": True,
        "routed_scaling_factor": float(header.arch_key("expert_weights_scale") or 1.0),
    })


def _glm4moe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """GLM-4.5 MoE: partial RoPE, q/k/v biases and q/k norms when the file has them, DeepSeek-V3's
    routing keys, and the block count without the multi-token-prediction layers llama.cpp's
    converter counts in (`nextn_predict_layers`; their tensors are skipped at load)."""
    _partial_rotary(header, cfg)
    names = [t.name for t in header.tensors]
    cfg["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
    cfg["use_qk_norm"] = any(n.endswith(".attn_q_norm.weight") for n in names)
    nextn = int(header.arch_key("nextn_predict_layers") or 0)
    cfg["num_hidden_layers"] -= nextn
    cfg["num_nextn_predict_layers"] = 0
    cfg.update({
        "n_routed_experts": int(_require(header, "expert_count")),
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "moe_intermediate_size": int(_require(header, "expert_feed_forward_length")),
        "n_shared_experts": int(header.arch_key("expert_shared_count") or 0),
        "first_k_dense_replace": int(header.arch_key("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(header.arch_key("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(header.arch_key("expert_weights_norm", False)),
        "n_group": int(header.arch_key("expert_group_count") or 1),
        "topk_group": int(header.arch_key("expert_group_used_count") or 1),
    })
    if (gating := header.arch_key("expert_gating_func")) not in (None, 2):
        raise ValueError(f"{header.path.name}: glm4moe expert_gating_func {gating} (only 2, sigmoid, is GLM's)")


def _minimax_m2_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """MiniMax-M2: partial RoPE (`rope.dimension_count` of `attention.key_length`), the experts
    (`expert_feed_forward_length` their width: HF's `intermediate_size`). llama.cpp always
    renormalizes the top-k (build_moe_ffn's norm_w) and needs the selection bias (exp_probs_b);
    its gating is sigmoid (the converter writes 2 from config.json's `scoring_func`, or nothing)."""
    _partial_rotary(header, cfg)
    if (gating := header.arch_key("expert_gating_func")) not in (None, 2):
        raise ValueError(f"{header.path.name}: minimax-m2 expert_gating_func {gating} (only 2, sigmoid, "
                         "is MiniMax-M2's)")
    if (scale := header.arch_key("expert_weights_scale")) not in (None, 0.0, 1.0):  # (HF scales by nothing)
        raise ValueError(f"{header.path.name}: minimax-m2 expert_weights_scale {scale} is not supported")
    if not any(t.name.endswith(".exp_probs_b.bias") for t in header.tensors):
        raise ValueError(f"{header.path.name}: minimax-m2 without exp_probs_b (the selection bias) tensors")
    cfg.update({
        "num_local_experts": int(_require(header, "expert_count")),
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "intermediate_size": int(header.arch_key("expert_feed_forward_length") or cfg["intermediate_size"]),
    })


def _ernie4_5_moe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """ERNIE 4.5 MoE: llama.cpp keeps softmax routing renormalized, experts from
    `leading_dense_block_count` to the last layer every `interleave_moe_layer_step`; `use_bias`
    when the file has q biases."""
    names = [t.name for t in header.tensors]
    cfg["use_bias"] = any(n.endswith(".attn_q.bias") for n in names)
    cfg.update({
        "moe_num_experts": int(_require(header, "expert_count")),
        "moe_k": int(_require(header, "expert_used_count")),
        "moe_intermediate_size": int(_require(header, "expert_feed_forward_length")),
        "moe_num_shared_experts": int(header.arch_key("expert_shared_count") or 0),
        "moe_layer_start_index": int(header.arch_key("leading_dense_block_count") or 0),
        "moe_layer_interval": int(header.arch_key("interleave_moe_layer_step") or 1),
        "moe_layer_end_index": cfg["num_hidden_layers"] - 1,
        "num_nextn_predict_layers": 0,
    })


def _llama4_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Llama 4 (conversion/llama.py's Llama4Model): its `feed_forward_length` is HF's
    `intermediate_size_mlp` (the dense layers'), `expert_feed_forward_length` the experts' (and
    the shared expert's) `intermediate_size`; experts every `interleave_moe_layer_step`-th layer.

    NOTE: the file keeps none of the NoPE layout, the attention chunk, the temperature or the
    q/k norm flag: llama.cpp fixes them (src/models/llama4.cpp) and so do we -- every 4th layer
    NoPE, chunks of 8192, floor_scale 8192, attn_scale 0.1, the q/k norm unless 128 experts
    (Maverick) -- except with `attention.sliding_window` 0 (every layer full attention with
    RoPE, as llama.cpp reads it)."""
    experts = int(_require(header, "expert_count"))
    cfg["intermediate_size_mlp"] = cfg["intermediate_size"]
    cfg.update({
        "intermediate_size": int(_require(header, "expert_feed_forward_length")),
        "num_local_experts": experts,
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "interleave_moe_layer_step": int(header.arch_key("interleave_moe_layer_step") or 1),
        "moe_layers": None,
        "attention_bias": any(t.name.endswith(".attn_q.bias") for t in header.tensors),
        "use_qk_norm": experts != 128,
    })
    theta_swa = header.arch_key("rope.freq_base_swa")
    if theta_swa is not None and float(theta_swa) != cfg.get("rope_theta", 10000.0):
        raise ValueError(f"{header.path.name}: llama4 rope.freq_base_swa {theta_swa} differs from "
                         f"rope.freq_base (one RoPE for every layer is supported)")
    n = cfg["num_hidden_layers"]
    window = header.arch_key("attention.sliding_window")
    if window is not None and int(window) == 0:
        cfg.update(no_rope_layers=[1] * n, layer_types=["full_attention"] * n)
        return
    cfg.update(attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, attn_temperature_tuning=True,
               no_rope_layer_interval=4, no_rope_layers=None, layer_types=None)


# per-architecture config hooks (the dense families of issue 35, GLM-4.5 MoE, ERNIE 4.5 MoE,
# Phi-3.5-MoE, MiniMax-M2)
_DENSE_FAMILY_CONFIG = {"phi3": _phi3_config, "gemma2": _gemma2_config, "granite": _granite_config,
                        "glm4": _glm4_config, "olmo2": _olmo2_config, "smollm3": _smollm3_config,
                        "glm4moe": _glm4moe_config, "ernie4_5-moe": _ernie4_5_moe_config,
                        "seed_oss": _seed_oss_config, "command-r": _cohere_config,
                        "cohere2": _cohere_config, "mistral3": _mistral3_config,
                        "phimoe": _phimoe_config, "exaone4": _exaone4_config, "llama4": _llama4_config,
                        "minimax-m2": _minimax_m2_config}


def _rope_scaling(header: GGUFHeader, head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF `rope_scaling` from `<arch>.rope.scaling.*` keys or a Llama 3 `rope_freqs` tensor."""
    kind = header.arch_key("rope.scaling.type")
    factor = header.arch_key("rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn" and (orig := header.arch_key("rope.scaling.original_context_length")):
            scaling["original_max_position_embeddings"] = int(orig)
        if kind == "yarn":  # what the converter copies from HF's yarn parameters
            for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                              ("yarn_beta_slow", "beta_slow")):
                if (value := header.arch_key(f"rope.scaling.{key}")) is not None:
                    scaling[name] = float(value)
            ext = header.arch_key("rope.scaling.yarn_ext_factor")
            if ext is not None and float(ext) != 1.0:  # HF's yarn has no extrapolation factor
                raise ValueError(f"{header.path.name}: rope.scaling.yarn_ext_factor {ext} is not supported "
                                 "(only 1.0, HF's YaRN)")
        return scaling
    if kind not in (None, "none") and factor not in (None, 1.0):
        raise ValueError(f"{header.path.name}: rope scaling type {kind!r} is not supported")

    info = header.tensor("rope_freqs.weight")
    if info is None:
        return None
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    factors = _read_tensor_f32(blob, info).double()  # [head_dim // 2]
    return _llama3_rope_scaling_from_factors(factors, head_dim, theta, header.path.name)


def _llama3_rope_scaling_from_factors(
    factors: torch.Tensor, head_dim: int, theta: float, file_name: str
) -> dict[str, Any]:
    """Recover HF's llama3 rope parameters from llama.cpp's per-frequency `rope_freqs` factors.

    llama.cpp's converter bakes Llama 3.x's rope scaling into one divisor per frequency; the four
    parameters it was computed from are not stored. Meta's released models use an original
    context of 8192 with low/high frequency factors 1 and 4 (Llama 3.1 - 3.3) or 1 and 1 (Llama 4
    Scout), with `factor` the largest divisor: try those, and accept the first that reproduces
    the stored factors.
    """
    factor = float(factors.max())
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [head_dim // 2]
    wavelen = 2 * math.pi / inv_freq
    old_ctx = 8192.0
    for low, high in ((1.0, 4.0), (1.0, 1.0)):
        # (low == high: the smooth band is empty; its formula would divide by 0)
        smooth = (old_ctx / wavelen - low) / (high - low) if high != low else torch.zeros_like(wavelen)
        expected = torch.where(
            wavelen < old_ctx / high,
            torch.ones_like(wavelen),
            torch.where(wavelen > old_ctx / low, torch.full_like(wavelen, factor),
                        1 / ((1 - smooth) / factor + smooth)),
        )  # [head_dim // 2]
        if factors.shape == expected.shape and torch.allclose(factors, expected, rtol=1e-4, atol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": 8192}
    raise ValueError(f"{file_name}: rope_freqs.weight does not match Llama 3 rope scaling; not supported")
