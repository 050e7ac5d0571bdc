"""GGUF files of Laguna (llama.cpp architecture "laguna"), as llama.cpp's convert_hf_to_gguf.py
writes them (conversion/laguna.py): the HF config they describe (`models.gguf_config` delegates
the architecture's metadata here; its tensors take `models.gguf_loader`'s common path).

Metadata: `attention.head_count` one count per layer (or one for all), `attention.head_count_kv`,
`attention.key_length` (the head width), `rope.dimension_count` / `rope.dimension_count_swa`
(the full / sliding layers' rotated parts), `rope.freq_base` / `rope.freq_base_swa`, the full
layers' YaRN keys, `attention.sliding_window` (absent: every layer full), the expert keys
(`expert_feed_forward_length`, `expert_shared_feed_forward_length`, `expert_weights_scale`,
`expert_weights_norm` true, `expert_gating_func` sigmoid) and `leading_dense_block_count`. No
layer pattern: llama.cpp's (and so ours) is `attention.sliding_window_pattern` when a file has
one, else every fourth layer full, from the first. The output gate's kind is read from the
`attn_gate` tensor: one row per head (per-head) or per channel (per-element).
Tensors: Llama's, per-head `attn_q_norm` / `attn_k_norm`, `attn_gate` (g_proj), the router and
its selection bias (`exp_probs_b`), experts stacked, the shared MLP (`ffn_*_shexp`); Q/K not
permuted (NEOX RoPE).
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.gguf_families import _yarn, common_config_fields

ARCHITECTURES = ("laguna",)
BLOCK_NAMES = {"attn_gate": "self_attn.g_proj"}  # (beside Llama's, the q/k norms' and the MoE names)
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a laguna GGUF."""
    req, key, name = header.require_arch_key, header.arch_key, header.path.name
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    n = int(req("block_count"))
    heads = req("attention.head_count")
    heads = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * n
    if len(heads) != n:
        raise ValueError(f"{name}: attention.head_count has {len(heads)} entries for {n} layers")
    head_dim = int(req("attention.key_length"))
    if key("expert_gating_func") not in (None, _SIGMOID):
        raise ValueError(f"{name}: laguna expert_gating_func {key('expert_gating_func')} is not supported (sigmoid)")
    if key("expert_weights_norm") is False:
        raise ValueError(f"{name}: laguna without expert_weights_norm is not supported (HF renormalizes)")
    window = int(key("attention.sliding_window") or 0)
    pattern = key("attention.sliding_window_pattern")
    if not window:
        sliding = [False] * n
    elif isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"{name}: attention.sliding_window_pattern has {len(pattern)} flags for {n} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's load_swa_pattern(4, dense_first): the full layers at i % 4 == 0
        sliding = [i % 4 != 0 for i in range(n)]
    dense = int(key("leading_dense_block_count") or 0)
    full_theta = float(key("rope.freq_base", 10000.0))
    full = {"rope_type": "default", "rope_theta": full_theta,
            "partial_rotary_factor": int(key("rope.dimension_count") or head_dim) / head_dim}
    if (yarn := _yarn(header)) is not None:
        full.update(yarn)
    swa = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa") or full_theta),
           "partial_rotary_factor": int(key("rope.dimension_count_swa") or head_dim) / head_dim}
    gate = header.tensor("blk.0.attn_gate.weight")
    if gate is None:
        raise ValueError(f"{name}: laguna needs the attn_gate tensors")
    rows = gate.shape[0]
    gating = True if rows == heads[0] else "per-element" if rows == heads[0] * head_dim else None
    if gating is None:
        raise ValueError(f"{name}: attn_gate has {rows} rows, neither {heads[0]} heads nor {heads[0]} x {head_dim}")
    cfg: dict[str, Any] = {
        "model_type": "laguna",
        "architectures": ["LagunaForCausalLM"],
        "hidden_size": int(req("embedding_length")),
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": n,
        "num_attention_heads": heads[0],
        "num_attention_heads_per_layer": heads,
        "num_key_value_heads": int(req("attention.head_count_kv")),
        "head_dim": head_dim,
        **common_config_fields(header, names, vocab),
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": full, "sliding_attention": swa},
        "num_experts": int(req("expert_count")),
        "num_experts_per_tok": int(req("expert_used_count")),
        "moe_intermediate_size": int(req("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length") or 0),
        "moe_routed_scaling_factor": float(key("expert_weights_scale") or 1.0),
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (n - dense),
        "gating": gating,
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{name}: cannot tell the vocabulary size")
    return cfg
