"""GGUF files of the Mamba2 hybrids as llama.cpp's converter writes them (conversion/mamba.py's
Mamba2Model, conversion/granite.py's GraniteHybridModel): architecture "granitehybrid"
(Granite 4.0-H) -- the HF config its header describes and its Mamba tensors under our names
(`models.gguf_config` / `models.gguf_loader` call in here).

The converter writes, besides Granite MoE's keys (`models.gguf_arch_config.granite_config`):
- `attention.head_count_kv` per layer, 0 on the Mamba layers (the layer types);
- `ssm.conv_kernel`, `ssm.state_size`, `ssm.group_count`, `ssm.inner_size` (I) and
  `ssm.time_step_rank` (the Mamba heads);
- `rope.scaling.finetuned`: whether the attention layers use RoPE (False for Granite 4.0-H,
  whose context length it then writes as 2^20);
and the tensors `ssm_in`, `ssm_conv1d` (`[C, L]`, squeezed), `ssm_dt.bias` (dt_bias), `ssm_a`
(A = -exp(A_log), `[H, 1]`, no suffix), `ssm_d` (`[H, 1]`, no suffix), `ssm_norm` (`[G, I / G]`),
`ssm_out`. Loading undoes those shapes and takes A_log = log(-A) (float rounding only). Q / K
rows are permuted as for Llama (`models.gguf_loader` undoes that).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.models.gguf_arch_config import granite_config
from pagedserve.models.gguf_reader import GGUFHeader

ARCHITECTURES = ("granitehybrid",)

# block tensor leaf -> our name under `model.layers.N.` (with the tensor's own suffix)
BLOCK_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
               "ssm_out": "mamba.out_proj"}
# block tensors whose full GGUF name (after `blk.N.`) maps to one parameter
_WHOLE_NAMES = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}


def hf_name(gguf_name: str) -> str | None:
    """Our name of an SSM tensor without a weight / bias leaf of its own (`blk.N.ssm_a`,
    `blk.N.ssm_d`, `blk.N.ssm_dt.bias`), or None."""
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _WHOLE_NAMES:
        return f"model.layers.{int(parts[1])}.{_WHOLE_NAMES[parts[2]]}"
    return None


def to_hf_layout(gguf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An SSM tensor in our layout: A_log from A, `[H]` for A / D, `[I]` for the norm, `[C, 1, L]`
    for the conv; other tensors unchanged."""
    leaf = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if leaf == "ssm_a":
        return torch.log(-tensor.reshape(-1))  # [H]
    if leaf in ("ssm_d", "ssm_norm"):
        return tensor.reshape(-1)  # [H] / [I]
    if leaf == "ssm_conv1d" and gguf_name.endswith(".weight") and tensor.dim() == 2:
        return tensor.unsqueeze(1)  # [C, 1, L]
    return tensor


def granite_hybrid_config(header: GGUFHeader, cfg: dict[str, Any], layer_kv: list[int] | None) -> None:
    """Granite 4.0-H's HF config kwargs (see the module docstring), in place."""
    n = cfg["num_hidden_layers"]
    kv = layer_kv if layer_kv is not None else [cfg["num_key_value_heads"]] * n
    if len(kv) != n:
        raise ValueError(f"{header.path.name}: attention.head_count_kv has {len(kv)} entries for {n} layers")
    names = {t.name for t in header.tensors}
    granite_config(header, cfg)
    heads, inner = int(header.require_arch_key("ssm.time_step_rank")), int(header.require_arch_key("ssm.inner_size"))
    hidden = cfg["hidden_size"]
    if inner % heads or inner % hidden:
        raise ValueError(f"{header.path.name}: ssm.inner_size {inner} must be a multiple of the Mamba heads "
                         f"({heads}) and of embedding_length ({hidden}) for an HF config")
    mamba = [i for i, k in enumerate(kv) if k == 0]
    first = mamba[0] if mamba else 0
    experts = int(header.arch_key("expert_count") or 0)
    cfg.update({
        "layer_types": ["mamba" if k == 0 else "attention" for k in kv],
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_expand": inner // hidden,
        "mamba_d_state": int(header.require_arch_key("ssm.state_size")),
        "mamba_n_groups": int(header.require_arch_key("ssm.group_count")),
        "mamba_d_conv": int(header.require_arch_key("ssm.conv_kernel")),
        "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": f"blk.{first}.ssm_in.bias" in names,
        "position_embedding_type": "rope" if header.arch_key("rope.scaling.finetuned") else "nope",
        "attention_bias": any(t.endswith(".attn_q.bias") for t in names),
        "num_local_experts": experts,
        "num_experts_per_tok": int(header.arch_key("expert_used_count") or 1),
        "shared_intermediate_size": int(header.arch_key("expert_shared_feed_forward_length")
                                        or cfg["intermediate_size"]),
    })
