"""GGUF files of MiMo-V2-Flash (llama.cpp architecture "mimo2"), as llama.cpp's
convert_hf_to_gguf.py writes them (conversion/mimo.py's MimoV2Model): the HF config they describe
(`models.gguf_config` delegates the architecture's metadata here; its tensors take
`models.gguf_loader`'s common path).

Metadata: `attention.head_count_kv` one count per block (the sliding layers' twice the full
ones'), `attention.sliding_window`, `attention.sliding_window_pattern` (one flag per block, 1:
sliding), `attention.key_length` / `value_length` (q/k and value head widths),
`rope.dimension_count` (the rotated part), `rope.freq_base` / `rope.freq_base_swa`,
`attention.value_scale` (absent: none, as llama.cpp), the expert keys (`expert_count`,
`expert_used_count`, `expert_feed_forward_length`, `expert_group_count` /
`expert_group_used_count`, `expert_weights_scale`; sigmoid routing, renormalized: llama.cpp's
fixed choice) and `nextn_predict_layers` (the MTP blocks after the model's, skipped). Dense
layers are those without a router (`ffn_gate_inp`), as llama.cpp reads them.
Tensors: Llama's names, `attn_sinks` (sliding layers), the router, `exp_probs_b`, experts stacked.
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.gguf_families import common_config_fields

ARCHITECTURES = ("mimo2",)
BLOCK_NAMES = {"attn_sinks": "self_attn.sinks"}  # (beside Llama's and the MoE names)


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a mimo2 GGUF."""
    req, key, name = header.require_arch_key, header.arch_key, header.path.name
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    n = int(req("block_count")) - int(key("nextn_predict_layers") or 0)
    pattern = req("attention.sliding_window_pattern")
    kv = req("attention.head_count_kv")
    kv = [int(k) for k in kv] if isinstance(kv, list) else [int(kv)] * len(pattern)
    if not isinstance(pattern, list) or len(pattern) < n or len(kv) < n:
        raise ValueError(f"{name}: mimo2 needs a sliding-window flag and a KV head count per block ({n})")
    sliding = [bool(p) for p in pattern[:n]]
    full_kv = {k for k, s in zip(kv[:n], sliding) if not s}
    swa_kv = {k for k, s in zip(kv[:n], sliding) if s}
    base = full_kv.pop() if full_kv else min(swa_kv) // 2
    if full_kv or len(swa_kv) > 1 or (swa_kv and swa_kv.pop() != 2 * base):
        raise ValueError(f"{name}: mimo2 KV heads {kv[:n]} are not {base} (full) and {2 * base} (sliding)")
    head_dim = int(req("attention.key_length"))
    rope = int(key("rope.dimension_count") or head_dim)
    theta = float(key("rope.freq_base", 10000.0))
    params = lambda t: {"rope_type": "default", "rope_theta": t, "partial_rotary_factor": rope / head_dim}  # noqa: E731
    scale = key("attention.value_scale")
    cfg: dict[str, Any] = {
        "model_type": "mimo_v2_flash",
        "architectures": ["MiMoV2FlashForCausalLM"],
        "hidden_size": int(req("embedding_length")),
        "intermediate_size": int(req("feed_forward_length")),
        "moe_intermediate_size": int(req("expert_feed_forward_length")),
        "num_hidden_layers": n,
        "num_attention_heads": int(req("attention.head_count")),
        "num_key_value_heads": base,
        "head_dim": head_dim,
        "v_head_dim": int(key("attention.value_length") or head_dim),
        **common_config_fields(header, names, vocab),
        "sliding_window": int(req("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": params(theta),
                            "sliding_attention": params(float(key("rope.freq_base_swa") or theta))},
        "attention_value_scale": float(scale) if scale is not None else 1.0,
        "n_routed_experts": int(req("expert_count")),
        "num_experts_per_tok": int(req("expert_used_count")),
        "n_group": int(key("expert_group_count") or 1),
        "topk_group": int(key("expert_group_used_count") or 1),
        "norm_topk_prob": True,
        "routed_scaling_factor": float(key("expert_weights_scale") or 1.0),
        "mlp_layer_types": ["sparse" if f"blk.{i}.ffn_gate_inp.weight" in names else "dense" for i in range(n)],
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{name}: cannot tell the vocabulary size")
    return cfg
