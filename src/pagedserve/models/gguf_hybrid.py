"""GGUF files of Qwen3-Next (llama.cpp architecture "qwen3next") and Qwen3.5 ("qwen35",
"qwen35moe"), as llama.cpp's convert_hf_to_gguf.py writes them: the HF config they describe and
their tensors under HF names (`models.gguf_loader` / `gguf_config` delegate them here).

The converter (conversion/qwen.py: Qwen3NextModel and its Qwen3.5 subclasses) writes the Gated
DeltaNet's sizes as `ssm.*` keys (`conv_kernel`, `state_size` = key head size, `group_count` =
key heads, `time_step_rank` = value heads, `inner_size` = value heads x value head size), the
layer pattern as `full_attention_interval` (every n-th layer full attention), the rotated part
as `rope.dimension_count`, Qwen3.5's multi-token-prediction blocks after the model's
(`nextn_predict_layers`: skipped here). Its tensor changes, undone here:

- every RMSNorm weight but the DeltaNet's gated norm stored as `1 + w` (llama.cpp's plain norm);
- `A_log` stored as `ssm_a` = `-exp(A_log)` (no `.weight` suffix), `dt_bias` as `ssm_dt.bias`,
  the conv weight squeezed to `[C, L]`;
- Qwen3-Next's fused `in_proj_qkvz` regrouped into `attn_qkv` (`[q | k | v]`) and `attn_gate`
  (z): our split layout already; `in_proj_ba` kept grouped (`ssm_ba`: the model splits it);
- Qwen3.5 with fewer key than value heads: the value heads reordered from grouped by key head
  to tiled (`v0 of every key head, v1 of every key head, ...`) in `attn_qkv`'s v rows,
  `attn_gate`, `ssm_beta` / `ssm_alpha`, `ssm_a`, `ssm_dt`, the conv's v channels and
  `ssm_out`'s columns. NOT undone: `ssm_out`'s columns cannot move inside quantized blocks, so
  the model runs in the tiled order (`linear_value_heads_tiled` in the config: value head j reads
  key head j mod Hk, `layers.gated_delta_net`), every one of these tensors kept as stored;
- the experts stacked `[E, out, in]` (`ffn_*_exps`), the shared expert's gate `[H]`.

llama.cpp's Qwen3-Next has experts in every layer, renormalizes the top-k (HF's default) and no
dense MLP layers; Qwen3.5-MoE always renormalizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")

# GGUF architecture -> (HF model_type, our class)
_MODELS = {"qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
           "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
           "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# leaves loaded as they are stored: may stay quantized blocks (`keep_quantized`)
_AS_STORED = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
              "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
              "ffn_down_shexp", "attn_qkv", "attn_gate", "ssm_out", "ssm_beta", "ssm_alpha",
              "token_embd.weight", "output.weight"}


def _req(header, key: str) -> Any:
    return header.require_arch_key(key)


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a qwen3next / qwen35 / qwen35moe GGUF."""
    from pagedserve.models.gguf_families import common_config_fields

    arch = header.architecture
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    hidden, heads = int(_req(header, "embedding_length")), int(_req(header, "attention.head_count"))
    head_dim = int(header.arch_key("attention.key_length") or hidden // heads)
    # Qwen3.5's multi-token-prediction blocks follow the model's: not run
    layers = int(_req(header, "block_count")) - int(header.arch_key("nextn_predict_layers") or 0)
    interval = int(header.arch_key("full_attention_interval") or 4)
    v_heads = int(_req(header, "ssm.time_step_rank"))
    model_type, cls = _MODELS[arch]
    rotated = header.arch_key("rope.dimension_count")
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [cls],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.arch_key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        **common_config_fields(header, names, vocab),
        "rope_theta": float(header.arch_key("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(rotated) / head_dim if rotated else 0.25,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
        "linear_conv_kernel_dim": int(_req(header, "ssm.conv_kernel")),
        "linear_key_head_dim": int(_req(header, "ssm.state_size")),
        "linear_num_key_heads": int(_req(header, "ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": int(_req(header, "ssm.inner_size")) // v_heads,
    }
    if (ff := header.arch_key("feed_forward_length")) is not None:
        cfg["intermediate_size"] = int(ff)
    if arch != "qwen35":
        cfg.update(num_experts=int(_req(header, "expert_count")),
                   num_experts_per_tok=int(_req(header, "expert_used_count")),
                   moe_intermediate_size=int(_req(header, "expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(_req(header, "expert_shared_feed_forward_length")))
    if arch == "qwen3next":
        cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif cfg["linear_num_key_heads"] != v_heads:  # (see the module docstring)
        cfg["linear_value_heads_tiled"] = True
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    return cfg


def hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The HF (or stacked-expert) name of GGUF tensor `gguf_name`, or None if not mapped;
    `""` for a multi-token-prediction block's tensor (skipped)."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):  # `blk.N.ssm_a` has no suffix
        stem, suffix = gguf_name, ""
    if stem in _TOP and suffix:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, leaf = int(parts[1]), parts[2]
    if layer >= num_layers:
        return ""
    prefix = f"model.layers.{layer}."
    if leaf == "ssm_a" and not suffix:
        return prefix + "linear_attn.A_log"
    if leaf == "ssm_dt" and suffix == "bias":
        return prefix + "linear_attn.dt_bias"
    mapped = _BLOCK.get(leaf)
    return None if mapped is None or not suffix else f"{prefix}{mapped}.{suffix}"


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`) for the tensors stored unchanged."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        name = hf_name(info.name, int(text.num_hidden_layers))
        if name is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for "
                             f"architecture {header.architecture!r}")
        if name:
            names[info.name] = name
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = names.get(info.name)
        if name is None:
            continue
        leaf = info.name.split(".")[2] if info.name.startswith("blk.") else info.name
        quantized = _read_quantized(blob, info) if keep_quantized and leaf in _AS_STORED else None
        if quantized is not None:
            yield name, quantized
            continue
        t = _read_tensor_f32(blob, info)
        if leaf == "ssm_a":
            t = torch.log(-t)  # -exp(A_log) -> A_log [Hv]
        elif leaf == "ssm_conv1d":
            t = t.unsqueeze(1)  # [C, L] -> [C, 1, L]
        elif leaf == "ffn_gate_inp_shexp" and t.dim() == 1:
            t = t.unsqueeze(0)  # [H] -> HF's [1, H]
        elif name.endswith("norm.weight") and leaf != "ssm_norm":
            t = t - 1.0  # the converter's 1 + w -> HF's zero-centred weight
        yield name, t
