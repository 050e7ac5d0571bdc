"""GGUF files of Granite SWA and Granite MoE SWA (llama.cpp architecture "granite_swa", both), as
llama.cpp's convert_hf_to_gguf.py writes them (conversion/granite.py's GraniteSWAModel and
GraniteMoeSWAModel): Granite's keys (`models.gguf_arch_config.granite_config`) plus
`attention.sliding_window`, `attention.sliding_window_pattern` (one flag a layer, True: sliding)
and, where the checkpoint has `no_rope_layers`, `attention.rope_pattern` (one flag a layer,
False: NoPE); the MoE one adds `expert_count` / `expert_used_count` and, with a shared MLP,
`expert_shared_feed_forward_length`. Tensors: Llama's (Q/K rows permuted), `attn_sinks`, and the
MoE one's experts kept fused: `ffn_gate_up_exps` `[E, 2I, H]` (gate rows, then up rows),
`ffn_down_exps`, the router `ffn_gate_inp`, the shared MLP's `ffn_up_shexp` `[2S, H]` (gate rows,
then up rows) and `ffn_down_shexp`, named here as transformers 5's checkpoint names them (the
model splits them: `models.granite_swa`).
NOTE: the file has one RoPE base (`rope.freq_base`); a checkpoint's `layer_rope_theta` with other
nonzero bases has no GGUF form.
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.gguf_arch_config import granite_config
from pagedserve.models.gguf_reader import GGUFHeader

ARCHITECTURES = ("granite_swa",)
HF_ARCHITECTURE = {"granite_swa": "GraniteSWAForCausalLM", "granitemoe_swa": "GraniteMoeSWAForCausalLM"}
# GGUF block leaf -> HF leaf under `model.layers.N.` (beside Llama's)
BLOCK_NAMES = {
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "block_sparse_moe.router",
    "ffn_gate_up_exps": "block_sparse_moe.experts.gate_up_proj",
    "ffn_down_exps": "block_sparse_moe.experts.down_proj",
    "ffn_up_shexp": "shared_mlp.input_linear",
    "ffn_down_shexp": "shared_mlp.output_linear",
}
PERMUTED_QK = ARCHITECTURES  # (llama.cpp's LlamaModel.permute)


def config_hook(header: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Granite's multipliers, the window and layer types, each layer's RoPE base (0: NoPE) and,
    with experts, Granite MoE SWA's expert fields (model type "granitemoe_swa")."""
    granite_config(header, cfg)
    n = cfg["num_hidden_layers"]
    name = header.path.name
    window = header.arch_key("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None
    pattern = header.arch_key("attention.sliding_window_pattern")
    if pattern is None:  # (HF's default: every fourth layer full, from the first)
        pattern = [i % 4 != 0 for i in range(n)]
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ValueError(f"{name}: attention.sliding_window_pattern must be one flag a layer ({n}), got {pattern!r}")
    cfg["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    theta = float(cfg.get("rope_theta", 10000.0))
    rope = header.arch_key("attention.rope_pattern")
    if rope is None:
        rope = [True] * n
    if not isinstance(rope, list) or len(rope) != n:
        raise ValueError(f"{name}: attention.rope_pattern must be one flag a layer ({n}), got {rope!r}")
    cfg["layer_rope_theta"] = [theta if r else 0.0 for r in rope]
    experts = header.arch_key("expert_count")
    if experts:
        cfg["model_type"] = "granitemoe_swa"
        cfg["architectures"] = [HF_ARCHITECTURE["granitemoe_swa"]]
        cfg["num_local_experts"] = int(experts)
        cfg["num_experts_per_tok"] = int(header.require_arch_key("expert_used_count"))
        cfg["shared_intermediate_size"] = int(header.arch_key("expert_shared_feed_forward_length") or 0)
