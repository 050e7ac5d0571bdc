"""The per-architecture parts of a GGUF header's HF config (`models.gguf_config`): each hook
reads what llama.cpp's converter writes for one architecture (its metadata keys, or the tensors
present) into the HF config kwargs `cfg`, in place. `ARCH_CONFIG_HOOKS` maps a
`general.architecture` to its hook; LFM2's (`lfm2_config`) also takes the per-layer KV head
counts the caller read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.models.gguf_reader import GGUFHeader, _read_tensor_f32


def _require(header: GGUFHeader, key: str) -> Any:
    return header.require_arch_key(key)


PARTIAL_ROPE_ARCHS = ("phi3", "glm4", "glm4moe", "cohere2", "minimax-m2")
COHERE_ARCHS = ("command-r", "cohere2")  # LayerNorm (attention.layer_norm_epsilon), not RMSNorm


def _partial_rotary(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """`partial_rotary_factor` from `rope.dimension_count` (the rotated part of each head)."""
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None:
        cfg["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]


def _phi3_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Phi-3: partial RoPE, LongRoPE (`phi3_longrope`); `sliding_window` (0: none), kept as HF
    keeps it (NOTE: llama.cpp disables Phi-3's sliding window; HF applies it)."""
    _partial_rotary(header, cfg)
    phi3_longrope(header, cfg)
    window = header.arch_key("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None


def phi3_longrope(header: GGUFHeader, cfg: dict[str, Any]) -> dict[str, Any] | None:
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
    if (scaling := phi3_longrope(header, cfg)) is not None:
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


def granite_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
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
    # EXAONE 4.5's multi-token-prediction blocks, counted in block_count (skipped at load)
    cfg["num_hidden_layers"] -= int(header.arch_key("nextn_predict_layers") or 0)
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


def lfm2_config(header: GGUFHeader, cfg: dict[str, Any], layer_kv: list[int] | None) -> None:
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


def _ernie4_5_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """ERNIE 4.5 (dense, and the MoE's attention): `use_bias` when the file has q biases."""
    cfg["use_bias"] = any(t.name.endswith(".attn_q.bias") for t in header.tensors)


def _ernie4_5_moe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """ERNIE 4.5 MoE: llama.cpp keeps softmax routing renormalized, experts from
    `leading_dense_block_count` to the last layer every `interleave_moe_layer_step`; `use_bias`
    when the file has q biases."""
    _ernie4_5_config(header, cfg)
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


def _hunyuan_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """HunYuan dense / MoE (conversion/hunyuan.py): `rope.freq_base` is already the checkpoints'
    NTK-alpha base (HF's "dynamic" + alpha folded in: a default rotation here), q / k / v / o
    biases with `attention_bias`; MoE: every layer's experts beside one shared MLP, both of HF's
    one `intermediate_size` (a file whose widths differ is refused)."""
    cfg["attention_bias"] = any(t.name.endswith(".attn_q.bias") for t in header.tensors)
    if header.architecture != "hunyuan-moe":
        return
    width = cfg["intermediate_size"]
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        if (value := header.arch_key(key)) is not None and int(value) != width:
            raise ValueError(f"{header.path.name}: {key} {value} differs from feed_forward_length {width} "
                             "(HF's HunYuan MoE has one intermediate_size)")
    if (shared := header.arch_key("expert_shared_count")) not in (None, 1):
        raise ValueError(f"{header.path.name}: expert_shared_count {shared} is not supported (HF's: one shared MLP)")
    cfg["num_experts"] = int(_require(header, "expert_count"))
    cfg["moe_topk"] = int(_require(header, "expert_used_count"))


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


QWEN_VL_ARCHS = ("qwen2vl", "qwen3vl", "qwen3vlmoe")


def _qwen_vl_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Qwen2-VL / Qwen2.5-VL ("qwen2vl"), Qwen3-VL ("qwen3vl") and Qwen3-VL-MoE ("qwen3vlmoe"):
    the text decoder llama.cpp's converter writes (conversion/qwenvl.py, qwen3vl.py; the vision
    tower goes to a separate mmproj file), read as Qwen2 / Qwen3 / Qwen3-MoE (the caller's model
    types; Qwen3-MoE's renormalized top-k is Qwen3-VL-MoE's router too).

    Its keys of its own change nothing on text: `rope.dimension_sections` (M-RoPE's sections
    [t, h, w, 0], checked: with one position for all of them, as a text-only prompt gives each
    token, it is the 1D RoPE of `rope.freq_base`; `models.qwen_vl`) and Qwen3-VL's
    `n_deepstack_layers` (how many of the first layers add the vision tower's DeepStack features:
    llama.cpp takes them from the input embedding's extra columns, zero for text tokens; HF adds
    them at image positions only)."""
    name = header.path.name
    sections = header.arch_key("rope.dimension_sections")
    if sections is not None and (not isinstance(sections, list) or len(sections) > 4
                                 or any(not isinstance(s, int) or s < 0 for s in sections)):
        raise ValueError(f"{name}: {header.architecture} rope.dimension_sections {sections!r} is not a list "
                         "of at most 4 non-negative section sizes")
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        raise ValueError(f"{name}: {header.architecture} rope.dimension_count {rope_dims} != head_dim "
                         f"{cfg['head_dim']} (partial RoPE is not Qwen-VL's)")


# per-architecture config hooks (the dense families of issue 35, GLM-4.5 MoE, ERNIE 4.5,
# HunYuan, Phi-3.5-MoE, MiniMax-M2, Llama 4, the Qwen VL text decoders)
ARCH_CONFIG_HOOKS = {"phi3": _phi3_config, "gemma2": _gemma2_config, "granite": granite_config,
                        "glm4": _glm4_config, "olmo2": _olmo2_config, "smollm3": _smollm3_config,
                        "glm4moe": _glm4moe_config, "ernie4_5-moe": _ernie4_5_moe_config,
                        "ernie4_5": _ernie4_5_config, "hunyuan-dense": _hunyuan_config,
                        "hunyuan-moe": _hunyuan_config,
                        "seed_oss": _seed_oss_config, "command-r": _cohere_config,
                        "cohere2": _cohere_config, "mistral3": _mistral3_config,
                        "phimoe": _phimoe_config, "exaone4": _exaone4_config, "llama4": _llama4_config,
                        "minimax-m2": _minimax_m2_config,
                        **{arch: _qwen_vl_config for arch in QWEN_VL_ARCHS}}


def _afmoe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """AfMoE (conversion/afmoe.py): the experts and shared experts, the dense first layers, the
    route scale; q/k/v/o biases when the file has them. llama.cpp fixes what the file does not
    say: muP's embedding scale always on (`mup_enabled`), sigmoid gating, and RoPE on every layer
    but each fourth -- HF ropes the sliding layers only, so the sliding pattern (from
    `attention.sliding_window_pattern`, default every fourth layer global) must be that one; a
    file whose global layers differ, with no window, without the renormalized top-k
    (`expert_weights_norm`: HF always renormalizes) or with its own sliding RoPE base is refused."""
    name, n = header.path.name, cfg["num_hidden_layers"]
    if (gating := header.arch_key("expert_gating_func")) not in (None, 2):
        raise ValueError(f"{name}: afmoe expert_gating_func {gating} (only 2, sigmoid, is AfMoE's)")
    if not header.arch_key("expert_weights_norm", False):
        raise ValueError(f"{name}: afmoe without expert_weights_norm (llama.cpp then skips the top-k "
                         "renormalization HF's AfMoE always does) is not supported")
    window = header.arch_key("attention.sliding_window")
    if not window:
        raise ValueError(f"{name}: afmoe without attention.sliding_window is not supported (llama.cpp "
                         "still ropes 3 layers of 4, HF's global layers none)")
    types = _window_layer_types(header, n)
    if any((t == "sliding_attention") != ((i + 1) % 4 != 0) for i, t in enumerate(types)):
        raise ValueError(f"{name}: afmoe sliding layers {types} are not every layer but each fourth "
                         "(llama.cpp's RoPE layers; HF ropes the sliding ones)")
    swa = header.arch_key("rope.freq_base_swa")
    if swa is not None and float(swa) != cfg.get("rope_theta", 10000.0):
        raise ValueError(f"{name}: afmoe rope.freq_base_swa {swa} differs from rope.freq_base (one RoPE "
                         "is supported)")
    names = [t.name for t in header.tensors]
    cfg.update({
        "layer_types": types,
        "sliding_window": int(window),
        "mup_enabled": True,
        "attention_bias": any(s.endswith(".attn_q.bias") for s in names),
        "num_experts": int(_require(header, "expert_count")),
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "moe_intermediate_size": int(_require(header, "expert_feed_forward_length")),
        "num_shared_experts": int(header.arch_key("expert_shared_count") or 0),
        "num_dense_layers": int(header.arch_key("leading_dense_block_count") or 0),
        "route_scale": float(header.arch_key("expert_weights_scale") or 1.0),
        "route_norm": True,
    })


ARCH_CONFIG_HOOKS["afmoe"] = _afmoe_config  # (AfMoE: Arcee Trinity)


def _exaone_moe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """EXAONE MoE (conversion/exaone.py's ExaoneMoEModel): the block count without the
    multi-token-prediction layers it counts in (`nextn_predict_layers`: skipped at load), the
    layer types from `attention.sliding_window_pattern` (llama.cpp ropes the sliding layers only,
    as HF with a window; a file without `attention.sliding_window` is refused, as llama.cpp
    does), DeepSeek-V3's routing keys (sigmoid; the selection bias as exp_probs_b), the shared
    experts (`expert_shared_feed_forward_length` must be their count times the experts' width:
    HF's one MLP of that size)."""
    name = header.path.name
    cfg["num_hidden_layers"] -= int(header.arch_key("nextn_predict_layers") or 0)
    n = cfg["num_hidden_layers"]
    window = header.arch_key("attention.sliding_window")
    if not window:
        raise ValueError(f"{name}: exaone-moe without attention.sliding_window is not supported "
                         "(llama.cpp requires it)")
    swa = header.arch_key("rope.freq_base_swa")
    if swa is not None and float(swa) != cfg.get("rope_theta", 10000.0):
        raise ValueError(f"{name}: exaone-moe rope.freq_base_swa {swa} differs from rope.freq_base (one "
                         "RoPE is supported)")
    if (gating := header.arch_key("expert_gating_func")) not in (None, 2):
        raise ValueError(f"{name}: exaone-moe expert_gating_func {gating} (only 2, sigmoid, is EXAONE MoE's)")
    width = int(_require(header, "expert_feed_forward_length"))
    shared = int(header.arch_key("expert_shared_count") or 0)
    shared_width = header.arch_key("expert_shared_feed_forward_length")
    if shared_width is not None and int(shared_width) != shared * width:
        raise ValueError(f"{name}: exaone-moe expert_shared_feed_forward_length {shared_width} is not "
                         f"expert_shared_count x expert_feed_forward_length ({shared} x {width})")
    cfg.update({
        "sliding_window": int(window),
        "layer_types": _window_layer_types(header, n),
        "num_experts": int(_require(header, "expert_count")),
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "moe_intermediate_size": width,
        "num_shared_experts": shared,
        "first_k_dense_replace": int(header.arch_key("leading_dense_block_count") or 0),
        "mlp_layer_types": None,
        "routed_scaling_factor": float(header.arch_key("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(header.arch_key("expert_weights_norm", False)),
        "n_group": int(header.arch_key("expert_group_count") or 1),
        "topk_group": int(header.arch_key("expert_group_used_count") or 1),
    })


ARCH_CONFIG_HOOKS["exaone-moe"] = _exaone_moe_config  # (EXAONE MoE: K-EXAONE)


def _cohere2moe_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Cohere 2 MoE (conversion/command_r.py's Cohere2MoeModel): RMSNorm when the file has
    `attention.layer_norm_rms_epsilon`, else Cohere's LayerNorm; the layer types from
    `attention.sliding_window_pattern`; dense layers below `leading_dense_block_count`, of
    `feed_forward_length` (HF's `prefix_dense_intermediate_size`), rotated whatever their window
    (llama.cpp's force_rope: HF's with `prefix_dense_sliding_window_pattern` 1); experts of
    `expert_feed_forward_length` (HF's `intermediate_size`) weighed by the softmax of the top-k
    logits (`expert_gating_func` 1) or their sigmoids (2, llama.cpp's default), renormalized with
    `expert_weights_norm`; the shared experts averaged with the routed ones (the converter refuses
    the "sum" combination). Biases are dropped by the converter (zero). MTP blocks
    (`nextn_predict_layers`) are skipped."""
    name = header.path.name
    cfg["num_hidden_layers"] -= int(header.arch_key("nextn_predict_layers") or 0)
    n = cfg["num_hidden_layers"]
    if header.arch_key("attention.layer_norm_rms_epsilon") is None:
        cfg.pop("rms_norm_eps", None)
        cfg["rms_norm_eps"] = None
        cfg["layer_norm_eps"] = float(_require(header, "attention.layer_norm_epsilon"))
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        raise ValueError(f"{name}: cohere2moe rope.dimension_count {rope_dims} != head_dim {cfg['head_dim']} "
                         "(HF's Cohere rotates whole heads)")
    swa = header.arch_key("rope.freq_base_swa")
    if swa is not None and float(swa) != cfg.get("rope_theta", 10000.0):
        raise ValueError(f"{name}: cohere2moe rope.freq_base_swa {swa} differs from rope.freq_base")
    gating = header.arch_key("expert_gating_func")
    if gating not in (None, 1, 2):
        raise ValueError(f"{name}: cohere2moe expert_gating_func {gating} (1 softmax, 2 sigmoid are Cohere's)")
    if (scale := header.arch_key("expert_weights_scale")) not in (None, 0.0, 1.0):
        raise ValueError(f"{name}: cohere2moe expert_weights_scale {scale} is not supported (HF scales by nothing)")
    width = int(_require(header, "expert_feed_forward_length"))
    shared = int(header.arch_key("expert_shared_count") or 0)
    shared_width = header.arch_key("expert_shared_feed_forward_length")
    if shared and shared_width is not None and int(shared_width) != shared * width:
        raise ValueError(f"{name}: cohere2moe expert_shared_feed_forward_length {shared_width} is not "
                         f"expert_shared_count x expert_feed_forward_length ({shared} x {width})")
    dense = int(_require(header, "leading_dense_block_count"))
    cfg.update({
        "logit_scale": float(_require(header, "logit_scale")),
        "sliding_window": int(_require(header, "attention.sliding_window")),
        "layer_types": _window_layer_types(header, n),
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
        "prefix_dense_sliding_window_pattern": 1,
        "prefix_dense_intermediate_size": cfg["intermediate_size"],
        "intermediate_size": width,
        "num_experts": int(_require(header, "expert_count")),
        "num_experts_per_tok": int(_require(header, "expert_used_count")),
        "num_shared_experts": shared,
        "shared_expert_combination_strategy": "average",
        "expert_selection_fn": "softmax" if gating == 1 else "sigmoid",
        "norm_topk_prob": bool(header.arch_key("expert_weights_norm", False)),
        "attention_bias": False,
    })


ARCH_CONFIG_HOOKS["cohere2moe"] = _cohere2moe_config  # (Cohere 2 MoE)


def _dbrx_config(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """DBRX (conversion/dbrx.py): HF's nested `attn_config` / `ffn_config` from the sizes, the
    clamp (`attention.clamp_kqv`: required, as llama.cpp reads it), the experts; llama.cpp always
    renormalizes the top-k (`moe_normalize_expert_weights` 1, the released models'). HF's
    LayerNorms use torch's default epsilon, 1e-5: a file with another is refused."""
    name = header.path.name
    if (eps := cfg.pop("layer_norm_eps", 1e-5)) != 1e-5 and abs(eps - 1e-5) > 1e-12:
        raise ValueError(f"{name}: dbrx attention.layer_norm_epsilon {eps} is not supported (HF's DBRX: 1e-5)")
    rope_dims = header.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        raise ValueError(f"{name}: dbrx rope.dimension_count {rope_dims} != head_dim {cfg['head_dim']}")
    if cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ValueError(f"{name}: dbrx head_dim {cfg['head_dim']} is not hidden / heads (HF's DBRX)")
    cfg.update({
        "d_model": cfg.pop("hidden_size"),
        "n_heads": cfg.pop("num_attention_heads"),
        "n_layers": cfg.pop("num_hidden_layers"),
        "max_seq_len": cfg.pop("max_position_embeddings"),
        "attn_config": {"kv_n_heads": cfg.pop("num_key_value_heads"),
                        "clip_qkv": float(_require(header, "attention.clamp_kqv")),
                        "rope_theta": float(cfg.pop("rope_theta", 10000.0))},
        "ffn_config": {"ffn_hidden_size": cfg.pop("intermediate_size"),
                       "moe_num_experts": int(_require(header, "expert_count")),
                       "moe_top_k": int(_require(header, "expert_used_count")),
                       "moe_normalize_expert_weights": 1.0},
    })
    cfg.pop("head_dim", None)


ARCH_CONFIG_HOOKS["dbrx"] = _dbrx_config  # (DBRX)
