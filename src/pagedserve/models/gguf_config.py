"""A GGUF header's metadata as the HF config a checkpoint of the same model would carry.

`build_gguf_config_dict(header)`: the `AutoConfig.for_model` kwargs (sizes, rope and its scaling,
MoE routing, the dense families' extras) from llama.cpp's metadata keys, for the architectures in
`SUPPORTED_ARCHITECTURES`; each architecture's own keys through its hook in
`models.gguf_arch_config`. `models.gguf_loader` caches the result per file with the tokenizer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_arch_config import (
    ARCH_CONFIG_HOOKS, COHERE_ARCHS, PARTIAL_ROPE_ARCHS, granite_config, lfm2_config)
from pagedserve.models import gguf_classic
from pagedserve.models import gguf_falcon, gguf_granite_swa, gguf_hy_v3, gguf_laguna
from pagedserve.models import gguf_mimo2, gguf_minicpm3, gguf_starcoder
from pagedserve.models.gguf_families import ARCHITECTURES as FAMILY_ARCHITECTURES
from pagedserve.models.gguf_families import common_config_fields
from pagedserve.models.gguf_gemma3n import ARCHITECTURES as GEMMA3N_ARCHITECTURES
from pagedserve.models.gguf_gemma4 import ARCHITECTURES as GEMMA4_ARCHITECTURES
from pagedserve.models.gguf_hybrid import ARCHITECTURES as HYBRID_ARCHITECTURES
from pagedserve.models.gguf_mamba import ARCHITECTURES as MAMBA_ARCHITECTURES
from pagedserve.models.gguf_mamba import OWN_CONFIG as MAMBA_OWN_CONFIG
from pagedserve.models.gguf_mamba import granite_hybrid_config
from pagedserve.models.gguf_reader import GGUFHeader, _read_tensor_f32

SUPPORTED_ARCHITECTURES = (
    "gemma3", "llama", "qwen2", "qwen3",
    "qwen2moe", "qwen3moe", "olmoe", "granitemoe", "glm4moe", "ernie4_5-moe",  # MoE (Mixtral: "llama")
    "phimoe", "minimax-m2",
    "phi3", "gemma2", "gemma", "granite", "glm4", "smollm3", "olmo2", "seed_oss",  # dense families of issue 35
    "command-r", "cohere2",  # Cohere: Command R / R+, Command R7B / A
    "mistral3",  # Mistral 3's text decoder: Mistral Small 3.x, Ministral 3
    "lfm2", "lfm2moe",  # short convolutions and attention layers (and experts)
    "exaone4", "ernie4_5",
    "hunyuan-dense", "hunyuan-moe",  # HunYuan dense (0.5B-7B), Hunyuan-A13B
    "llama4",  # Llama 4's text decoder
    "qwen2vl", "qwen3vl", "qwen3vlmoe",  # Qwen2(.5)-VL's, Qwen3-VL's, Qwen3-VL-MoE's text decoders
) + gguf_classic.ARCHITECTURES + FAMILY_ARCHITECTURES + HYBRID_ARCHITECTURES + MAMBA_ARCHITECTURES \
    + GEMMA4_ARCHITECTURES + GEMMA3N_ARCHITECTURES
# deepseek2, gpt-oss (models/gguf_families.py); qwen3next, qwen35, qwen35moe
# (models/gguf_hybrid.py); the Mamba2 hybrids (models/gguf_mamba.py); gemma4 (models/gguf_gemma4.py);
# gemma3n (models/gguf_gemma3n.py);
# phi2, stablelm, starcoder2, gptneox, olmo, arcee, nemotron, apertus (models/gguf_classic.py)
"""GGUF `general.architecture` values that `iter_gguf_weights` and `load_gguf_config` handle."""
SUPPORTED_ARCHITECTURES += ("afmoe", "exaone-moe", "cohere2moe", "dbrx")  # more MoE families: AfMoE, EXAONE MoE, Cohere 2 MoE, DBRX

_HF_MODEL_TYPE = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
                  "granitemoe": "granitemoe", "glm4moe": "glm4_moe", "ernie4_5-moe": "ernie4_5_moe",
                  "ernie4_5": "ernie4_5", "hunyuan-dense": "hunyuan_v1_dense",
                  "hunyuan-moe": "hunyuan_v1_moe"}
_HF_MODEL_TYPE.update({a: a for a in ("phi3", "gemma2", "gemma", "granite", "glm4", "smollm3", "olmo2", "seed_oss",
                                        "phimoe", "cohere2", "exaone4")})
_HF_MODEL_TYPE["command-r"] = "cohere"
_HF_MODEL_TYPE["mistral3"] = "mistral"  # "ministral3" with a temperature scale (below)
_HF_MODEL_TYPE.update(lfm2="lfm2", lfm2moe="lfm2_moe", llama4="llama4_text")
_HF_MODEL_TYPE["minimax-m2"] = "minimax_m2"
# the Qwen VL text decoders, read as the decoder families they are (models/gguf_arch_config.py)
_HF_MODEL_TYPE.update(qwen2vl="qwen2", qwen3vl="qwen3", qwen3vlmoe="qwen3_moe")
_HF_MODEL_TYPE["granitehybrid"] = "granitemoehybrid"
_HF_MODEL_TYPE.update(gguf_classic.HF_MODEL_TYPE)  # the older dense families (models/gguf_classic.py)
_HF_ARCHITECTURE = {
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma": "GemmaForCausalLM",
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
    "ernie4_5": "Ernie4_5ForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    **gguf_classic.HF_ARCHITECTURE,
}
_HF_MODEL_TYPE["afmoe"] = "afmoe"
_HF_ARCHITECTURE["afmoe"] = "AfmoeForCausalLM"
_HF_MODEL_TYPE["exaone-moe"] = "exaone_moe"
_HF_ARCHITECTURE["exaone_moe"] = "ExaoneMoeForCausalLM"
_HF_MODEL_TYPE["cohere2moe"] = "cohere2_moe"
_HF_ARCHITECTURE["cohere2_moe"] = "Cohere2MoeForCausalLM"
_HF_MODEL_TYPE["dbrx"] = "dbrx"
_HF_ARCHITECTURE["dbrx"] = "DbrxForCausalLM"
# Granite SWA / Granite MoE SWA (models/gguf_granite_swa.py)
SUPPORTED_ARCHITECTURES += gguf_granite_swa.ARCHITECTURES
_HF_MODEL_TYPE["granite_swa"] = "granite_swa"
_HF_ARCHITECTURE.update(gguf_granite_swa.HF_ARCHITECTURE)
ARCH_CONFIG_HOOKS["granite_swa"] = gguf_granite_swa.config_hook
SUPPORTED_ARCHITECTURES += gguf_minicpm3.ARCHITECTURES  # (its own reader: models/gguf_minicpm3.py)
SUPPORTED_ARCHITECTURES += gguf_laguna.ARCHITECTURES  # (its own config: models/gguf_laguna.py)
# HunYuan V3 (models/gguf_hy_v3.py)
SUPPORTED_ARCHITECTURES += gguf_hy_v3.ARCHITECTURES
_HF_MODEL_TYPE["hy_v3"] = "hy_v3"
_HF_ARCHITECTURE["hy_v3"] = "HYV3ForCausalLM"
ARCH_CONFIG_HOOKS["hy_v3"] = gguf_hy_v3.config_hook
SUPPORTED_ARCHITECTURES += gguf_starcoder.ARCHITECTURES  # (its own reader: models/gguf_starcoder.py)
SUPPORTED_ARCHITECTURES += gguf_falcon.ARCHITECTURES  # (its own reader: models/gguf_falcon.py)
SUPPORTED_ARCHITECTURES += gguf_mimo2.ARCHITECTURES  # (its own config: models/gguf_mimo2.py)
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
    if arch in gguf_minicpm3.ARCHITECTURES:
        return gguf_minicpm3.config_dict(header)
    if arch in gguf_laguna.ARCHITECTURES:
        return gguf_laguna.config_dict(header)
    if arch in gguf_starcoder.ARCHITECTURES:
        return gguf_starcoder.config_dict(header)
    if arch in gguf_falcon.ARCHITECTURES:
        return gguf_falcon.config_dict(header)
    if arch in gguf_mimo2.ARCHITECTURES:
        return gguf_mimo2.config_dict(header)
    if arch in HYBRID_ARCHITECTURES:  # qwen3next, qwen35, qwen35moe: models/gguf_hybrid.py
        from pagedserve.models import gguf_hybrid

        return gguf_hybrid.config_dict(header)
    if arch in GEMMA4_ARCHITECTURES:  # models/gguf_gemma4.py
        from pagedserve.models import gguf_gemma4

        return gguf_gemma4.config_dict(header)
    if arch in GEMMA3N_ARCHITECTURES:  # models/gguf_gemma3n.py
        from pagedserve.models import gguf_gemma3n

        return gguf_gemma3n.config_dict(header)
    if arch in MAMBA_OWN_CONFIG:  # nemotron_h, nemotron_h_moe, falcon-h1: models/gguf_mamba.py
        from pagedserve.models.gguf_mamba import config_dict

        return config_dict(header)
    md = header.metadata
    tensor_names = {t.name for t in header.tensors}

    hidden = int(_require(header, "embedding_length"))
    n_heads = int(_require(header, "attention.head_count"))
    n_kv = header.arch_key("attention.head_count_kv", n_heads)
    layer_kv = None
    if isinstance(n_kv, list) and arch in ("lfm2", "lfm2moe", "granitehybrid"):  # 0: conv / Mamba layers
        layer_kv, n_kv = n_kv, max(n_kv)
    if isinstance(n_kv, list):  # per-layer counts (not used by our other architectures)
        raise ValueError(f"{header.path.name}: per-layer attention.head_count_kv is not supported")
    head_dim = header.arch_key("attention.key_length")
    if not head_dim and arch not in PARTIAL_ROPE_ARCHS + gguf_classic.PARTIAL_ROPE_ARCHS:  # there rope.dimension_count is the rotated part
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
        "intermediate_size": _feed_forward_length(header),
        "num_hidden_layers": int(_require(header, "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        **common_config_fields(header, tensor_names, vocab_size, layer_norm=arch in COHERE_ARCHS + gguf_classic.LAYER_NORM_ARCHS
                               or arch == "dbrx"
                               or (arch == "cohere2moe" and header.arch_key("attention.layer_norm_rms_epsilon") is None)),
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    if (unk := md.get("tokenizer.ggml.unknown_token_id")) is not None:
        cfg["unk_token_id"] = unk
    if (theta := header.arch_key("rope.freq_base")) is not None:
        cfg["rope_theta"] = float(theta)
    rope_scaling = (None if arch in ("phi3", "phimoe")  # (their LongRoPE: phi3_longrope)
                    else _rope_scaling(header, head_dim, cfg.get("rope_theta", 10000.0)))
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if arch in ARCH_CONFIG_HOOKS:
        ARCH_CONFIG_HOOKS[arch](header, cfg)
    if arch in gguf_classic.ARCHITECTURES:
        gguf_classic.config_hook(header, cfg)
    if arch in ("lfm2", "lfm2moe"):
        lfm2_config(header, cfg, layer_kv)
    if arch == "granitehybrid":
        granite_hybrid_config(header, cfg, layer_kv)

    if model_type == "mistral":
        # NOTE: MistralConfig defaults to a 4096-token sliding window (v0.1); llama.cpp runs "llama"
        # GGUFs with full attention and stores no window, so neither do we.
        cfg["sliding_window"] = None
    if model_type in _MOE_RENORMALIZE:
        cfg.update(_moe_config(header, model_type, cfg))
    if arch == "granitemoe":
        granite_config(header, cfg)
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


def _feed_forward_length(header: GGUFHeader) -> int:
    """`feed_forward_length` (the dense MLPs' width); a "glm4moe" file with experts in every layer
    may have none (Solar Open's converter writes none): then the experts' width, unused."""
    width = header.arch_key("feed_forward_length")
    if width is None and header.architecture == "glm4moe" and not header.arch_key("leading_dense_block_count"):
        width = _require(header, "expert_feed_forward_length")
    return int(width if width is not None else _require(header, "feed_forward_length"))


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
