"""GGUF files of HunYuan V3 (llama.cpp architecture "hy_v3"), as llama.cpp's convert_hf_to_gguf.py
writes them (conversion/hunyuan.py's HYV3Model): the common keys (`models.gguf_config`) plus the
expert ones -- `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`expert_shared_feed_forward_length` (moe_intermediate_size x num_shared_experts),
`expert_weights_norm`, `expert_weights_scale` (router_scaling_factor), `expert_gating_func`
(sigmoid) -- and, with an MTP block, `nextn_predict_layers` (its blocks skipped). No key says
which layers are dense: as llama.cpp, the layers without a router (`ffn_gate_inp`) are.
Tensors: Llama's names, per-head `attn_q_norm` / `attn_k_norm`, the router, its selection bias
(`blk.N.exp_probs_b`, no suffix: HF's `mlp.expert_bias` has none), experts stacked, the shared
MLP (`ffn_*_shexp`); Q/K not permuted.
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.gguf_reader import GGUFHeader

ARCHITECTURES = ("hy_v3",)
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a tensor without a `.weight` / `.bias` suffix: `blk.N.exp_probs_b`."""
    parts = gguf_name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] == "exp_probs_b":
        return f"model.layers.{int(parts[1])}.mlp.gate.e_score_correction_bias"
    return None


def config_hook(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """The expert fields and each layer's feed-forward kind (see the module docstring)."""
    key, req, name = header.arch_key, header.require_arch_key, header.path.name
    if key("expert_gating_func") not in (None, _SIGMOID):
        raise ValueError(f"{name}: hy_v3 expert_gating_func {key('expert_gating_func')} is not supported (sigmoid)")
    if key("expert_weights_norm") is False:
        raise ValueError(f"{name}: hy_v3 without expert_weights_norm is not supported (HF renormalizes)")
    inter = int(req("expert_feed_forward_length"))
    shared = int(key("expert_shared_feed_forward_length") or 0)
    if shared % inter:
        raise ValueError(f"{name}: expert_shared_feed_forward_length {shared} is not a multiple of {inter}")
    names = {t.name for t in header.tensors}
    cfg.update(num_experts=int(req("expert_count")), num_experts_per_tok=int(req("expert_used_count")),
               moe_intermediate_size=inter, num_shared_experts=shared // inter,
               router_scaling_factor=float(key("expert_weights_scale") or 1.0),
               mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_inp.weight" in names else "dense"
                                for i in range(cfg["num_hidden_layers"])])
