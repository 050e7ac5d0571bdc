"""Tiny Granite 4.0-H GGUF files written as llama.cpp's converter writes them
(conversion/granite.py's GraniteHybridModel over conversion/mamba.py's Mamba2Model): architecture
"granitehybrid", Granite MoE's keys and split tensors, KV heads per layer (0: Mamba), the `ssm.*`
keys, `rope.scaling.finetuned` as "uses RoPE", and the Mamba tensors reshaped (`ssm_conv1d`
squeezed, `ssm_a` = -exp(A_log) and `ssm_d` as `[H, 1]`, `ssm_norm` as `[G, I / G]`, dt_bias as
`ssm_dt.bias`); Q/K rows permuted as Llama's."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from moe_gguf import _permute, split_granite, stack_experts

ARCH = gguf.MODEL_ARCH.GRANITE_HYBRID


def _gguf_name(name_map, config, hf_name: str) -> str:
    """The converter's GGUF name of one (split) HF tensor."""
    base, suffix = hf_name.rsplit(".", 1)
    if suffix in ("A_log", "D"):
        base, suffix = hf_name, ""
    elif suffix == "dt_bias":
        base, suffix = f"{base}.dt_proj", "bias"
    parts = base.split(".")
    if len(parts) > 4 and parts[3] in ("block_sparse_moe", "shared_mlp") and parts[4] in (
            "experts", "shared_gate", "shared_up", "output_linear"):
        bid, leaf = parts[2], ".".join(parts[3:])
        shexp = "_shexp" if config.num_local_experts else ""  # (the shared MLP alone: ffn_*)
        leaf = {"block_sparse_moe.experts.gate_proj": "ffn_gate_exps",
                "block_sparse_moe.experts.up_proj": "ffn_up_exps",
                "block_sparse_moe.experts.down_proj": "ffn_down_exps",
                "shared_mlp.shared_gate": f"ffn_gate{shexp}", "shared_mlp.shared_up": f"ffn_up{shexp}",
                "shared_mlp.output_linear": f"ffn_down{shexp}"}[leaf]
        mapped = f"blk.{bid}.{leaf}"
    else:
        mapped = name_map.get_name(base)
    assert mapped is not None, hf_name
    return f"{mapped}.{suffix}" if suffix else mapped


def write_granite_hybrid_gguf(path: Path, config, state: dict[str, torch.Tensor], *,
                              types: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """`state` (HF names) as the converter writes Granite 4.0-H (or Bamba: RoPE on half of each
    head, no Granite scales or experts); `types` picks a storage type per substring of the HF
    name (first match; default F32)."""
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH])
    writer.add_name("tiny granitehybrid")
    bamba = config.model_type == "bamba"
    rope = bamba or config.position_embedding_type == "rope"
    writer.add_context_length(config.max_position_embeddings if rope else 2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    attention = [t in ("attention", "full_attention") for t in config.layers_block_type]
    writer.add_head_count_kv([config.num_key_value_heads if a else 0 for a in attention])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim // 2 if bamba else head_dim)  # (Bamba: attn_rotary_emb)
    writer.add_vocab_size(config.vocab_size)
    if not bamba:
        if config.num_local_experts:
            writer.add_expert_count(config.num_local_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    inner = config.mamba_n_heads * config.mamba_d_head
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_rope_scaling_finetuned(rope)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    name_map = gguf.get_tensor_name_map(ARCH, config.num_hidden_layers)
    state = state if bamba else split_granite(state, config)
    for hf_name, tensor in stack_experts(state).items():
        gguf_name = _gguf_name(name_map, config, hf_name)
        data = tensor.detach().float()
        if hf_name.endswith(".A_log"):
            data = -torch.exp(data)
        if hf_name.endswith((".A_log", ".D")):
            data = data.reshape(-1, 1)  # [H, 1]
        elif hf_name.endswith(".mamba.norm.weight"):
            data = data.reshape(config.mamba_n_groups, -1)  # [G, I / G]
        elif hf_name.endswith(".conv1d.weight"):
            data = data.squeeze(1)  # [C, L]
        data = data.numpy()
        if ".q_proj." in hf_name:
            data = _permute(data, config.num_attention_heads)
        if ".k_proj." in hf_name:
            data = _permute(data, config.num_key_value_heads)
        qtype = next((t for key, t in (types or {}).items() if key in hf_name), gguf.GGMLQuantizationType.F32)
        if data.ndim == 1 or "ffn_gate_inp" in gguf_name or "ssm_conv1d" in gguf_name or data.shape[-1] == 1:
            qtype = gguf.GGMLQuantizationType.F32  # as the converter keeps them
        if qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ssm_tensor(name: str, data: torch.Tensor, groups: int) -> torch.Tensor:
    """conversion/mamba.py's Mamba2Model reshapes: A = -exp(A_log) and D as `[H, 1]`, the norm
    as `[G, I / G]`, the conv squeezed to `[C, L]`."""
    if name.endswith("A_log"):
        return (-torch.exp(data)).reshape(-1, 1)
    if name.endswith(".D"):
        return data.reshape(-1, 1)
    if name.endswith("norm.weight") and ".mixer." in name or name.endswith("mamba.norm.weight"):
        return data.reshape(groups, -1)
    if name.endswith("conv1d.weight"):
        return data.squeeze(1)
    return data


def _ssm_gguf_leaf(leaf: str) -> str | None:
    return {"in_proj.weight": "ssm_in.weight", "in_proj.bias": "ssm_in.bias",
            "conv1d.weight": "ssm_conv1d.weight", "conv1d.bias": "ssm_conv1d.bias",
            "dt_bias": "ssm_dt.bias", "A_log": "ssm_a", "D": "ssm_d", "norm.weight": "ssm_norm.weight",
            "out_proj.weight": "ssm_out.weight", "out_proj.bias": "ssm_out.bias"}.get(leaf)


def _write(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray], types) -> None:
    for gguf_name, (hf_name, data) in tensors.items():
        qtype = next((t for key, t in (types or {}).items() if key in hf_name), gguf.GGMLQuantizationType.F32)
        if data.ndim == 1 or data.shape[-1] % 32 or "ssm_conv1d" in gguf_name or "ffn_gate_inp" in gguf_name:
            qtype = gguf.GGMLQuantizationType.F32  # as the converter keeps them
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vocab(writer: gguf.GGUFWriter, config) -> None:
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_nemotron_h_gguf(path: Path, config, state: dict[str, torch.Tensor], *, types=None) -> Path:
    """A Nemotron-H checkpoint as conversion/nemotron.py's NemotronHModel writes it:
    "nemotron_h_moe" with MoE blocks (else "nemotron_h"), per-layer KV heads and MLP widths, the
    RMS epsilon as `attention.layer_norm_epsilon`, the `backbone.*` tensors under GGUF names
    (each block's norm `attn_norm`, experts stacked, latent projections `ffn_latent_*`)."""
    types_ = list(config.layers_block_type)
    moe = "moe" in types_
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("tiny nemotron_h")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(2**20)
    writer.add_embedding_length(config.hidden_size)
    width = config.moe_intermediate_size if moe else config.intermediate_size
    writer.add_feed_forward_length([width if t in ("mlp", "moe") else 0 for t in types_])
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.num_key_value_heads if t == "full_attention" else 0 for t in types_])
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_state_size(config.ssm_state_size)
    writer.add_ssm_group_count(config.n_groups)
    writer.add_ssm_inner_size(config.mamba_num_heads * config.mamba_head_dim)
    writer.add_ssm_time_step_rank(config.mamba_num_heads)
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if moe:
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
        writer.add_expert_shared_count(1)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        if config.moe_latent_size:
            writer.add_moe_latent_size(config.moe_latent_size)
    _vocab(writer, config)
    top = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    leaves = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "up_proj": "ffn_up", "down_proj": "ffn_down", "gate": "ffn_gate_inp",
              "shared_experts.up_proj": "ffn_up_shexp", "shared_experts.down_proj": "ffn_down_shexp",
              "fc1_latent_proj": "ffn_latent_down", "fc2_latent_proj": "ffn_latent_up"}
    tensors, experts = {}, {}
    for name, t in state.items():
        data = t.detach().float()
        if name in top:
            tensors[top[name]] = (name, data.numpy())
            continue
        bid, rest = name.split(".")[2], name.split(".", 3)[3]  # backbone.layers.N.<rest>
        if rest == "norm.weight":
            tensors[f"blk.{bid}.attn_norm.weight"] = (name, data.numpy())
            continue
        leaf = rest.removeprefix("mixer.")
        if leaf.startswith("experts."):  # experts.E.<up|down>_proj.weight, stacked below
            _, e, proj, _ = leaf.split(".")
            experts.setdefault((bid, proj), {})[int(e)] = data
            continue
        if leaf == "gate.e_score_correction_bias":
            tensors[f"blk.{bid}.exp_probs_b.bias"] = (name, data.numpy())
            continue
        if types_[int(bid)] == "linear_attention":
            tensors[f"blk.{bid}.{_ssm_gguf_leaf(leaf)}"] = (name, _ssm_tensor(name, data, config.n_groups).numpy())
            continue
        stem, suffix = leaf.rsplit(".", 1)
        if stem == "q_proj":
            data = torch.from_numpy(_permute(data.numpy(), config.num_attention_heads))
        elif stem == "k_proj":
            data = torch.from_numpy(_permute(data.numpy(), config.num_key_value_heads))
        tensors[f"blk.{bid}.{leaves[stem]}.{suffix}"] = (name, data.numpy())
    for (bid, proj), parts in experts.items():
        stacked = torch.stack([parts[i] for i in range(len(parts))]).numpy()  # [E, out, in]
        tensors[f"blk.{bid}.ffn_{proj.removesuffix('_proj')}_exps.weight"] = (f"experts.{proj}", stacked)
    _write(writer, tensors, types)
    return path


def write_falcon_h1_gguf(path: Path, config, state: dict[str, torch.Tensor], *, types=None) -> Path:
    """A Falcon-H1 checkpoint as conversion/falcon_h1.py's FalconH1Model writes it: every muP
    multiplier folded into the weights, the pre-MLP norm as `blk.N.ffn_norm` (no leaf), Q/K not
    permuted."""
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.FALCON_H1])
    writer.add_name("tiny falcon-h1")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_block_count(config.num_hidden_layers)
    inner = config.mamba_d_ssm
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    _vocab(writer, config)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, config.num_hidden_layers)
    groups = config.mamba_n_groups * config.mamba_d_state
    tensors = {}
    for name, t in state.items():
        data = t.detach().float().clone()
        if "down_proj" in name:
            data = data * config.mlp_multipliers[1]
        elif "gate_proj" in name:
            data = data * config.mlp_multipliers[0]
        elif "k_proj" in name:
            data = data * config.key_multiplier * config.attention_in_multiplier
        elif "q_proj" in name or "v_proj" in name:
            data = data * config.attention_in_multiplier
        elif "o_proj" in name:
            data = data * config.attention_out_multiplier
        elif "out_proj" in name:
            data = data * config.ssm_out_multiplier
        elif "in_proj" in name:
            data = data * config.ssm_in_multiplier
            for (a, b), m in zip(((0, inner), (inner, 2 * inner), (2 * inner, 2 * inner + groups),
                                  (2 * inner + groups, 2 * inner + 2 * groups), (2 * inner + 2 * groups, None)),
                                 config.ssm_multipliers):
                data[a:b] *= m
        elif "lm_head" in name:
            data = data * config.lm_head_multiplier
        elif "embed_tokens" in name:
            data = data * config.embedding_multiplier
        if ".mamba." in name:
            bid, leaf = name.split(".")[2], name.split(".mamba.", 1)[1]
            tensors[f"blk.{bid}.{_ssm_gguf_leaf(leaf)}"] = (name, _ssm_tensor(name, data, config.mamba_n_groups).numpy())
        elif name.endswith("pre_ff_layernorm.weight"):
            tensors[f"blk.{name.split('.')[2]}.ffn_norm"] = (name, data.numpy())
        else:
            base, suffix = name.rsplit(".", 1)
            mapped = name_map.get_name(base)
            assert mapped is not None, name
            tensors[f"{mapped}.{suffix}"] = (name, data.numpy())
    _write(writer, tensors, types)
    return path


def check_mamba_gguf(write, hf_model, folder: Path, tmp_path: Path, prompts, check_hf) -> torch.nn.Module:
    """The model from a GGUF file `write(path, config, state, types=)` converts from the HF
    `folder`: F32 tensors give HF's logits (`check_hf`); with Q8_0 projections kept as blocks,
    HF's greedy tokens by the tie rule. Returns the F32 model."""
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    from pagedserve.models.loader import iter_safetensors

    config, state = hf_model.config, dict(iter_safetensors(folder))
    model = load_gguf_model(write(tmp_path / "f32.gguf", config, state), tmp_path / "cache", quantized=False)
    assert type(model).__name__ == config.architectures[0]
    check_hf(hf_model, model, prompts)
    q8 = write(tmp_path / "q8.gguf", config, state, types={"_proj": gguf.GGMLQuantizationType.Q8_0})
    quantized = load_gguf_model(q8, tmp_path / "cache", quantized=True)
    assert quantized.model.layers[0].mamba.in_proj.weight.dtype == torch.uint8
    check_greedy_tie_rule(hf_model, quantized, prompts[:2], "Q8_0")
    return model


def write_jamba_gguf(path: Path, config, state: dict[str, torch.Tensor], *, types=None) -> Path:
    """A Jamba checkpoint as conversion/jamba.py's JambaModel writes it: "jamba", KV heads per
    layer (0: Mamba), the `ssm.*` sizes (`time_step_rank`: dt_rank), no period keys (the MoE
    layers are the blocks with a router), experts stacked, `ssm_conv1d` squeezed, `ssm_a` =
    -exp(A_log) `[I, N]`, `ssm_d`; Q/K as they are (no RoPE)."""
    arch = gguf.MODEL_ARCH.JAMBA
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("tiny jamba")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.num_key_value_heads if t == "attention" else 0
                              for t in config.layers_block_type])
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_time_step_rank(config.mamba_dt_rank)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    _vocab(writer, config)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for hf_name, tensor in state.items():
        data = tensor.detach().float()
        parts = hf_name.split(".")
        if ".feed_forward.experts." in hf_name:  # model.layers.N.feed_forward.experts.E.gate_proj.weight
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = data
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if suffix in ("A_log", "D"):
            base, suffix = hf_name, ""
        mapped = name_map.get_name(base)
        assert mapped is not None, hf_name
        if hf_name.endswith(".A_log"):
            data = -torch.exp(data)  # [I, N]
        elif hf_name.endswith(".conv1d.weight"):
            data = data.squeeze(1)  # [I, L]
        tensors[f"{mapped}.{suffix}" if suffix else mapped] = (hf_name, data.numpy())
    for (bid, leaf), per_expert in experts.items():
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])  # [E, out, in]
        short = leaf.removesuffix("_proj")
        tensors[f"blk.{bid}.ffn_{short}_exps.weight"] = (f"experts.{leaf}", stacked.numpy())
    _write(writer, tensors, types)
    return path


def write_mamba_gguf(path: Path, config, state: dict[str, torch.Tensor], *, types=None) -> Path:
    """A Mamba, Falcon Mamba or Mamba2 checkpoint as conversion/mamba.py writes it: "mamba"
    (`ssm.dt_b_c_rms` for Falcon Mamba; `time_step_rank` dt_rank, `ssm_a` = -exp(A_log) `[I, N]`)
    or "mamba2" (`time_step_rank` the heads, `group_count`; A, D as `[H, 1]`, the norm as
    `[G, I / G]`, dt_bias as `ssm_dt.bias`), each layer's norm `attn_norm`, the conv squeezed,
    no `output.weight` when tied."""
    two = config.model_type == "mamba2"
    arch = gguf.MODEL_ARCH.MAMBA2 if two else gguf.MODEL_ARCH.MAMBA
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {config.model_type}")
    writer.add_context_length(2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(config.num_hidden_layers)
    inner = config.num_heads * config.head_dim if two else config.intermediate_size
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(config.state_size)
    writer.add_ssm_time_step_rank(config.num_heads if two else config.time_step_rank)
    if two:
        writer.add_ssm_group_count(config.n_groups)
    else:
        writer.add_ssm_dt_b_c_rms(config.model_type == "falcon_mamba")
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    _vocab(writer, config)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for hf_name, tensor in state.items():
        data = tensor.detach().float()
        base, suffix = hf_name.rsplit(".", 1)
        if suffix in ("A_log", "D"):
            base, suffix = hf_name, ""
        elif suffix == "dt_bias":
            base, suffix = f"{base}.dt_proj", "bias"
        mapped = name_map.get_name(base)
        assert mapped is not None, hf_name
        if two:
            data = _ssm_tensor(hf_name, data, config.n_groups)
        elif hf_name.endswith(".A_log"):
            data = -torch.exp(data)  # [I, N]
        elif hf_name.endswith(".conv1d.weight"):
            data = data.squeeze(1)  # [I, L]
        tensors[f"{mapped}.{suffix}" if suffix else mapped] = (hf_name, data.numpy())
    _write(writer, tensors, types)
    return path
