"""GGUF files of the Mamba2 hybrids (and Jamba's Mamba 1) as llama.cpp's converter writes them
(conversion/mamba.py's Mamba2Model, conversion/granite.py's GraniteHybridModel): architecture "granitehybrid"
(Granite 4.0-H, and Bamba: RoPE on, no Granite scales, no experts) -- the HF config its header
describes and its Mamba tensors under our names (`models.gguf_config` / `models.gguf_loader`
call in here).

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

Nemotron-H ("nemotron_h"; "nemotron_h_moe" with MoE blocks: conversion/nemotron.py) adds
per-layer `feed_forward_length` and KV heads (the block types are read from the tensors each
block has), `attention.layer_norm_epsilon` (RMSNorm's), the head size as
`attention.key_length` and the MoE keys (`expert_*`, `moe_latent_size`; tensors `ffn_up_exps`,
`ffn_down_exps`, `ffn_latent_down` / `ffn_latent_up`, `exp_probs_b`, `ffn_*_shexp`); each
block's one norm is `attn_norm`. Falcon-H1 ("falcon-h1": conversion/falcon_h1.py) folds every
muP multiplier into the weights (the HF config's multipliers are then all 1), keeps the gated
norm when `ssm_norm` is there (gate before the norm, as llama.cpp runs it) and writes the
pre-MLP norm as `blk.N.ffn_norm` without a leaf; its Q / K rows are not permuted.

The pure state-space models (conversion/mamba.py): "mamba" (Mamba, and Falcon Mamba with
`ssm.dt_b_c_rms` true: weightless dt / B / C norms, run by llama.cpp with the layer norms'
epsilon, which the config then takes as `mixer_rms_eps`) and "mamba2" (Mamba-Codestral) write
each layer's norm as `attn_norm`, the `ssm.*` sizes (mamba: `time_step_rank` is dt_rank;
mamba2: the heads) and no attention keys; "mamba"'s tensors are Jamba's Mamba 1 ones without
the norms, "mamba2"'s the Mamba2 hybrids'.

Jamba ("jamba": conversion/jamba.py, Mamba 1: `layers.mamba1`) writes no layer periods: the
attention layers are those with KV heads, the MoE layers those with a router (`ffn_gate_inp`);
`ssm.time_step_rank` is dt_rank, `ssm_a` is -exp(A_log) `[I, N]`, dt_proj is `ssm_dt` (weight and
bias), the dt / B / C norms `ssm_dt_norm`, `ssm_b_norm`, `ssm_c_norm`; Q / K are not permuted.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.models.gguf_arch_config import granite_config
from pagedserve.models.gguf_reader import GGUFHeader

ARCHITECTURES = ("granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1", "jamba", "mamba", "mamba2")
# (`config_dict`; granitehybrid: a hook)
OWN_CONFIG = ("nemotron_h", "nemotron_h_moe", "falcon-h1", "jamba", "mamba", "mamba2")
PERMUTED_QK = ("granitehybrid", "nemotron_h", "nemotron_h_moe")  # (llama.cpp's LlamaModel.permute)

# block tensor leaf -> our name under `model.layers.N.` (with the tensor's own suffix)
_SSM_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
              "ssm_out": "mamba.out_proj"}
_NEMOTRON_NAMES = {
    **_SSM_NAMES, "attn_norm": "norm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction_bias", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj", "ffn_latent_down": "mlp.fc1_latent_proj",
    "ffn_latent_up": "mlp.fc2_latent_proj"}
# block tensors whose full GGUF name (after `blk.N.`) maps to one parameter
_WHOLE_NAMES = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}
_FALCON_WHOLE_NAMES = {**_WHOLE_NAMES, "ffn_norm": "post_attention_layernorm.weight"}
# Jamba's Mamba 1 (layers/mamba1.py): dt_proj's bias is `ssm_dt.bias` of its own weight
_JAMBA_NAMES = {**_SSM_NAMES, "ssm_x": "mamba.x_proj", "ssm_dt": "mamba.dt_proj",
                "ssm_dt_norm": "mamba.dt_layernorm", "ssm_b_norm": "mamba.b_layernorm",
                "ssm_c_norm": "mamba.c_layernorm"}
_JAMBA_WHOLE_NAMES = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D"}
# the pure state-space models (models/mamba.py): each layer's one norm is attn_norm
_MAMBA_NAMES = {"attn_norm": "norm", **{k: v for k, v in _JAMBA_NAMES.items() if not k.endswith("_norm")}}
_MAMBA2_NAMES = {"attn_norm": "norm", **_SSM_NAMES}


def block_names(arch: str, llama: dict[str, str], moe: dict[str, str]) -> dict[str, str]:
    """`arch`'s GGUF block leaf -> our name map, from `models.gguf_loader`'s Llama and MoE ones."""
    if arch.startswith("nemotron_h"):
        return _NEMOTRON_NAMES
    if arch == "falcon-h1":
        return {**llama, **_SSM_NAMES}
    if arch == "jamba":
        return {**llama, **moe, **_JAMBA_NAMES}
    if arch in ("mamba", "mamba2"):
        return _MAMBA_NAMES if arch == "mamba" else _MAMBA2_NAMES
    return {**llama, **moe, **_SSM_NAMES}  # granitehybrid: Granite MoE's names (or the shared MLP alone)


def hf_name(arch: str, gguf_name: str) -> str | None:
    """Our name of a tensor without a weight / bias leaf of its own (`blk.N.ssm_a`, `blk.N.ssm_d`,
    `blk.N.ssm_dt.bias`; Falcon-H1's `blk.N.ffn_norm`), or None."""
    parts = gguf_name.split(".", 2)
    whole = {"falcon-h1": _FALCON_WHOLE_NAMES, "jamba": _JAMBA_WHOLE_NAMES,
             "mamba": _JAMBA_WHOLE_NAMES}.get(arch, _WHOLE_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in whole:
        return f"model.layers.{int(parts[1])}.{whole[parts[2]]}"
    return None


def to_hf_layout(gguf_name: str, tensor: torch.Tensor, arch: str = "") -> torch.Tensor:
    """An SSM tensor in our layout: A_log from A, `[H]` for A / D (Mamba 1's A stays `[I, N]`),
    `[I]` for the norm, `[C, 1, L]` for the conv; other tensors unchanged."""
    leaf = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if leaf == "ssm_a":
        return torch.log(-tensor) if arch in ("jamba", "mamba") else torch.log(-tensor.reshape(-1))  # [I, N] / [H]
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
        "head_dim": hidden // cfg["num_attention_heads"],  # (rope.dimension_count: Bamba's half)
    })
    granite = any(header.arch_key(k) is not None for k in ("attention.scale", "embedding_scale",
                                                            "residual_scale", "logit_scale"))
    if cfg["position_embedding_type"] == "rope" and not granite and not experts:
        _as_bamba(header, cfg, names)


def _as_bamba(header: GGUFHeader, cfg: dict[str, Any], names: set[str]) -> None:
    """Bamba, which the converter also writes as "granitehybrid" (RoPE on, no Granite scales,
    no experts): its HF config, RoPE on half of each head (HF's Bamba fixes that half)."""
    rope = header.arch_key("rope.dimension_count")
    if rope is not None and int(rope) * 2 != cfg["head_dim"]:
        raise ValueError(f"{header.path.name}: a Bamba GGUF rotating {rope} of {cfg['head_dim']} dims per head; "
                         "HF's Bamba rotates half")
    kinds = cfg.pop("layer_types")
    for key in ("position_embedding_type", "num_local_experts", "num_experts_per_tok", "shared_intermediate_size"):
        cfg.pop(key)
    cfg.update(model_type="bamba", architectures=["BambaForCausalLM"],
               attn_layer_indices=[i for i, k in enumerate(kinds) if k == "attention"],
               mlp_bias=any(t.endswith(".ffn_up.bias") for t in names))


def _mamba_fields(header: GGUFHeader, names: set[str]) -> dict[str, Any]:
    """Sizes and biases of the Mamba layers (HF's Nemotron-H names; Falcon-H1 renames them)."""
    heads, inner = int(header.require_arch_key("ssm.time_step_rank")), int(header.require_arch_key("ssm.inner_size"))
    if inner % heads:
        raise ValueError(f"{header.path.name}: ssm.inner_size {inner} is not a multiple of the Mamba heads ({heads})")
    first = next((int(n.split(".")[1]) for n in names if n.endswith(".ssm_in.weight")), 0)
    return {"mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "ssm_state_size": int(header.require_arch_key("ssm.state_size")),
            "n_groups": int(header.require_arch_key("ssm.group_count")),
            "conv_kernel": int(header.require_arch_key("ssm.conv_kernel")),
            "use_conv_bias": f"blk.{first}.ssm_conv1d.bias" in names,
            "use_bias": f"blk.{first}.ssm_in.bias" in names}


def _per_layer(header: GGUFHeader, key: str, n: int) -> list[int]:
    value = header.require_arch_key(key)
    values = [int(v) for v in value][:n] if isinstance(value, list) else [int(value)] * n
    if len(values) != n:
        raise ValueError(f"{header.path.name}: {key} has {len(values)} entries for {n} layers")
    return values


def config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a Nemotron-H, Falcon-H1 or Jamba GGUF."""
    from pagedserve.models.gguf_families import common_config_fields

    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    if header.architecture == "jamba":
        return _jamba(header, names, common_config_fields(header, names, vocab))
    if header.architecture in ("mamba", "mamba2"):
        return _pure_mamba(header, names, common_config_fields(header, names, vocab))
    # (Nemotron's multi-token-prediction block comes last: not run, not loaded -- gguf_loader)
    n = int(header.require_arch_key("block_count")) - int(header.arch_key("nextn_predict_layers") or 0)
    nemotron = header.architecture.startswith("nemotron_h")
    common = common_config_fields(header, names, vocab, layer_norm=nemotron)
    if nemotron:  # (its RMSNorm's epsilon, under LayerNorm's key)
        common["layer_norm_epsilon"] = common.pop("layer_norm_eps")
    cfg: dict[str, Any] = {
        "hidden_size": int(header.require_arch_key("embedding_length")),
        "num_hidden_layers": n,
        "num_attention_heads": int(header.require_arch_key("attention.head_count")),
        "head_dim": int(header.require_arch_key("attention.key_length")),
        "attention_bias": any(t.endswith(".attn_q.bias") for t in names),
        "mlp_bias": any(t.endswith((".ffn_up.bias", ".ffn_down.bias")) for t in names),
        **common,
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    mamba = _mamba_fields(header, names)
    if not nemotron:
        return {**cfg, **_falcon_h1(header, names, mamba)}
    kv = _per_layer(header, "attention.head_count_kv", n)
    types = [_nemotron_block(header, names, i) for i in range(n)]
    mlp = next((t for t in header.tensors if t.name.endswith(".ffn_up.weight")), None)
    width = mlp.shape[0] if mlp is not None else max(_per_layer(header, "feed_forward_length", n)) or 1
    cfg.update(mamba, model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
               layers_block_type=types, num_key_value_heads=max(kv) or 1, intermediate_size=int(width))
    if "moe" in types:
        cfg.update({
            "n_routed_experts": int(header.require_arch_key("expert_count")),
            "num_experts_per_tok": int(header.require_arch_key("expert_used_count")),
            "moe_intermediate_size": int(header.require_arch_key("expert_feed_forward_length")),
            "moe_shared_expert_intermediate_size": int(header.require_arch_key(
                "expert_shared_feed_forward_length")),
            "moe_latent_size": int(latent) if (latent := header.arch_key("moe_latent_size")) else None,
            "n_group": int(header.arch_key("expert_group_count") or 1),
            "topk_group": int(header.arch_key("expert_group_used_count") or 1),
            "norm_topk_prob": bool(header.arch_key("expert_weights_norm", True)),
            "routed_scaling_factor": float(header.arch_key("expert_weights_scale") or 1.0),
        })
    return cfg


def _nemotron_block(header: GGUFHeader, names: set[str], i: int) -> str:
    """Block i's type by its tensors. NOTE: not by `feed_forward_length`: the converter takes a
    config with `num_experts_per_tok` (transformers 5 saves its default in every Nemotron-H
    config) for a MoE one and then writes 0 for the dense MLP blocks."""
    for leaf, kind in (("ssm_in", "linear_attention"), ("attn_q", "full_attention"),
                       ("ffn_up_exps", "moe"), ("ffn_up", "mlp")):
        if f"blk.{i}.{leaf}.weight" in names:
            return kind
    raise ValueError(f"{header.path.name}: block {i} has no Mamba, attention, MLP or MoE tensors")


def _falcon_h1(header: GGUFHeader, names: set[str], mamba: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's own kwargs: the Mamba sizes under its names, the norm, RoPE; the multipliers
    left at 1 (folded into the weights by the converter)."""
    return {
        "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
        "num_key_value_heads": int(header.require_arch_key("attention.head_count_kv")),
        "intermediate_size": int(header.require_arch_key("feed_forward_length")),
        "rope_theta": float(header.arch_key("rope.freq_base", 10000.0)),
        "mamba_d_ssm": mamba["mamba_num_heads"] * mamba["mamba_head_dim"],
        "mamba_n_heads": mamba["mamba_num_heads"], "mamba_d_head": mamba["mamba_head_dim"],
        "mamba_d_state": mamba["ssm_state_size"], "mamba_n_groups": mamba["n_groups"],
        "mamba_d_conv": mamba["conv_kernel"], "mamba_conv_bias": mamba["use_conv_bias"],
        "mamba_proj_bias": mamba["use_bias"],
        "projectors_bias": any(t.endswith(".ssm_out.bias") for t in names),
        "mamba_rms_norm": any(t.endswith(".ssm_norm.weight") for t in names),
        "mamba_norm_before_gate": False,  # (llama.cpp gates, then norms)
    }


def _layer_period(header: GGUFHeader, which: list[bool], what: str) -> tuple[int, int]:
    """(period, offset) with `i % period == offset` exactly for the layers `which` marks (none:
    an offset past the last layer); ValueError when no period fits."""
    n, on = len(which), [i for i, w in enumerate(which) if w]
    if not on:
        return n + 1, n
    period = on[1] - on[0] if len(on) > 1 else n
    offset = on[0] % period
    if offset != on[0] or [i % period == offset for i in range(n)] != which:
        raise ValueError(f"{header.path.name}: the {what} layers {on} are not every k-th layer, as HF's "
                         f"Jamba config describes them")
    return period, offset


def _jamba(header: GGUFHeader, names: set[str], common: dict[str, Any]) -> dict[str, Any]:
    """Jamba's HF config kwargs (conversion/jamba.py): the attention layers from the per-layer KV
    heads (0: Mamba), the MoE layers from which blocks have a router (`ffn_gate_inp`; the
    converter writes no period keys), the Mamba 1 sizes from `ssm.*`. Q / K are not permuted
    (no RoPE)."""
    n = int(header.require_arch_key("block_count"))
    hidden = int(header.require_arch_key("embedding_length"))
    kv = _per_layer(header, "attention.head_count_kv", n)
    inner = int(header.require_arch_key("ssm.inner_size"))
    if inner % hidden:
        raise ValueError(f"{header.path.name}: ssm.inner_size {inner} must be a multiple of embedding_length "
                         f"({hidden}) for an HF config")
    if common["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    attn_period, attn_offset = _layer_period(header, [k > 0 for k in kv], "attention")
    experts = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(n)]
    expert_period, expert_offset = _layer_period(header, experts, "MoE")
    mamba = [i for i, k in enumerate(kv) if k == 0]
    first = mamba[0] if mamba else 0
    return {
        **common,
        "model_type": "jamba", "architectures": ["JambaForCausalLM"],
        "hidden_size": hidden, "num_hidden_layers": n,
        "intermediate_size": int(header.require_arch_key("feed_forward_length")),
        "num_attention_heads": int(header.require_arch_key("attention.head_count")),
        "num_key_value_heads": max(kv) or 1,
        "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
        "expert_layer_period": expert_period, "expert_layer_offset": expert_offset,
        "num_experts": int(header.arch_key("expert_count") or 1) if any(experts) else 1,
        "num_experts_per_tok": int(header.arch_key("expert_used_count") or 1),
        "mamba_d_state": int(header.require_arch_key("ssm.state_size")),
        "mamba_d_conv": int(header.require_arch_key("ssm.conv_kernel")),
        "mamba_expand": inner // hidden,
        "mamba_dt_rank": int(header.require_arch_key("ssm.time_step_rank")),
        "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": f"blk.{first}.ssm_in.bias" in names,
    }


def _pure_mamba(header: GGUFHeader, names: set[str], common: dict[str, Any]) -> dict[str, Any]:
    """The HF config kwargs of a "mamba" (Mamba, Falcon Mamba) or "mamba2" GGUF
    (conversion/mamba.py): the sizes from `ssm.*`, the layer norms' epsilon (RMSNorm's key)."""
    hidden = int(header.require_arch_key("embedding_length"))
    inner = int(header.require_arch_key("ssm.inner_size"))
    if inner % hidden:
        raise ValueError(f"{header.path.name}: ssm.inner_size {inner} must be a multiple of embedding_length "
                         f"({hidden}) for an HF config")
    if common["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    eps = common.pop("rms_norm_eps")
    common.pop("max_position_embeddings")  # (2^20, "arbitrary": no position limit)
    cfg = {
        **common, "hidden_size": hidden, "num_hidden_layers": int(header.require_arch_key("block_count")),
        "state_size": int(header.require_arch_key("ssm.state_size")),
        "conv_kernel": int(header.require_arch_key("ssm.conv_kernel")), "expand": inner // hidden,
        "layer_norm_epsilon": eps, "use_conv_bias": "blk.0.ssm_conv1d.bias" in names,
        "use_bias": "blk.0.ssm_in.bias" in names,
    }
    rank = int(header.require_arch_key("ssm.time_step_rank"))
    if header.architecture == "mamba2":
        if inner % rank:
            raise ValueError(f"{header.path.name}: ssm.inner_size {inner} is not a multiple of the Mamba heads "
                             f"({rank})")
        return {**cfg, "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "num_heads": rank,
                "head_dim": inner // rank, "n_groups": int(header.require_arch_key("ssm.group_count"))}
    cfg.update(intermediate_size=inner, time_step_rank=rank)
    if header.arch_key("ssm.dt_b_c_rms"):  # (llama.cpp norms dt, B, C with the layers' epsilon)
        return {**cfg, "model_type": "falcon_mamba", "architectures": ["FalconMambaForCausalLM"],
                "mixer_rms_eps": eps}
    return {**cfg, "model_type": "mamba", "architectures": ["MambaForCausalLM"]}
