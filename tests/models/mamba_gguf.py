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
    """`state` (HF names) as the converter writes Granite 4.0-H; `types` picks a storage type
    per substring of the HF name (first match; default F32)."""
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH])
    writer.add_name("tiny granitehybrid")
    rope = config.position_embedding_type == "rope"
    writer.add_context_length(config.max_position_embeddings if rope else 2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    attention = [t in ("attention", "full_attention") for t in config.layer_types]
    writer.add_head_count_kv([config.num_key_value_heads if a else 0 for a in attention])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
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
    for hf_name, tensor in stack_experts(split_granite(state, config)).items():
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
