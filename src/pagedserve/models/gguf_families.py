"""GGUF files of DeepSeek V2 / V3 and GLM-4.7-Flash (llama.cpp architecture "deepseek2") and
gpt-oss ("gpt-oss"), as llama.cpp's convert_hf_to_gguf.py writes them: the HF config they
describe and their tensors under HF names (`models.gguf_loader` delegates these architectures
here).

deepseek2 (conversion/deepseek.py, and glm.py's `Glm4MoeLiteModel`): MLA metadata
(`attention.kv_lora_rank`, `key_length_mla` = qk_nope + qk_rope, `value_length_mla` =
v_head_dim, `rope.dimension_count` = qk_rope, `attention.q_lora_rank` when there is one;
`attention.head_count_kv` is 1: MLA run as MQA), the MoE keys (`leading_dense_block_count`,
`expert_*`; `expert_gating_func` 2 = sigmoid, and so is no key beside an `exp_probs_b` tensor =
V3's correction bias: GLM-4.7-Flash's files) and YaRN's `rope.scaling.yarn_log_multiplier` (0.1 *
mscale_all_dim). Newer converters split `kv_b_proj` into `attn_k_b` `[H, r, qk_nope]` (W_uk
transposed) and `attn_v_b` `[H, v, r]`; they are joined back here (older files: `attn_kv_b`).
Experts are stacked (`ffn_*_exps` `[E, out, in]`), loaded under the MoE layer's stacked names.

gpt-oss (conversion/gpt_oss.py): gate / up experts already split (`ffn_gate_exps`, `ffn_up_exps`,
with biases), MXFP4 blocks as GGUF type MXFP4, `attn_sinks`, `post_attention_norm`, the router
with a bias (`ffn_gate_inp`); llama.cpp fixes what it does not store (sliding window on even
layers, SwiGLU alpha 1.702 / limit 7.0, YaRN without truncation), and so does HF's config.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedserve.models.gguf_reader import _read_quantized, _read_tensor_f32

ARCHITECTURES = ("deepseek2", "gpt-oss")

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DEEPSEEK2 = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GPT_OSS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
}
# stacked experts `[E, out, in]`: GGUF leaf -> the MoE layer's stacked parameter, named as
# llama.cpp's merged tensor (`...experts.gate_proj.weight` / `.bias`)
_EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
_SKIPPED = {"rope_freqs.weight"}


def _req(header, key: str) -> Any:
    return header.require_arch_key(key)


def common_config_fields(header, tensor_names, vocab_size, *, layer_norm: bool = False) -> dict[str, Any]:
    """The HF config kwargs every GGUF family reads alike: context length, the norms' epsilon
    (RMSNorm's `rms_norm_eps`; with `layer_norm`, LayerNorm's `layer_norm_eps`: Cohere),
    vocabulary, tied embeddings and the special token ids."""
    md = header.metadata
    eps = (("layer_norm_eps", "attention.layer_norm_epsilon") if layer_norm
           else ("rms_norm_eps", "attention.layer_norm_rms_epsilon"))
    return {
        "max_position_embeddings": int(_req(header, "context_length")),
        eps[0]: float(_req(header, eps[1])),
        "vocab_size": int(vocab_size) if vocab_size is not None else None,
        # NOTE: llama.cpp writes output.weight only when the LM head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def config_dict(header) -> dict[str, Any]:
    """The HF config kwargs (for `AutoConfig.for_model`) of a deepseek2 / gpt-oss GGUF."""
    names = {t.name for t in header.tensors}
    token_embd = header.tensor("token_embd.weight")
    vocab = header.arch_key("vocab_size") or (token_embd.shape[0] if token_embd is not None else None)
    cfg: dict[str, Any] = {
        "hidden_size": int(_req(header, "embedding_length")),
        "num_hidden_layers": int(_req(header, "block_count")),
        "num_attention_heads": int(_req(header, "attention.head_count")),
        **common_config_fields(header, names, vocab),
        "rope_theta": float(header.arch_key("rope.freq_base", 10000.0)),
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{header.path.name}: cannot tell the vocabulary size")
    if header.architecture == "deepseek2":
        cfg.update(_deepseek2(header, names))
    else:
        cfg.update(_gpt_oss(header))
    return cfg


def _yarn(header, **extra) -> dict[str, Any] | None:
    kind = header.arch_key("rope.scaling.type")
    factor = header.arch_key("rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind != "yarn":
        raise ValueError(f"{header.path.name}: rope scaling type {kind!r} is not supported here")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    if (orig := header.arch_key("rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if (value := header.arch_key(key)) is not None:
            scaling[name] = float(value)
    scaling.update(extra)
    return scaling


def _deepseek2(header, names: set[str]) -> dict[str, Any]:
    rope_dim = int(_req(header, "rope.dimension_count"))
    experts = header.arch_key("expert_count")
    bias = any(n.endswith(".exp_probs_b.bias") for n in names)
    gating = header.arch_key("expert_gating_func")
    # NOTE: no gating key with the correction bias: sigmoid, as HF's V3 router always is. The
    # converter writes the key from config.json's `scoring_func`, which GLM-4.7-Flash's lacks
    # (llama.cpp picks sigmoid for that model by its layer count and vocabulary).
    sigmoid = gating == 2 or (gating is None and bias)
    v3 = sigmoid or bias
    groups = int(header.arch_key("expert_group_count") or 1)
    out: dict[str, Any] = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": int(_req(header, "attention.head_count")),  # HF's: heads (MHA)
        "intermediate_size": int(_req(header, "feed_forward_length")),
        "kv_lora_rank": int(_req(header, "attention.kv_lora_rank")),
        "q_lora_rank": int(q) if (q := header.arch_key("attention.q_lora_rank")) else None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": int(_req(header, "attention.key_length_mla")) - rope_dim,
        "v_head_dim": int(_req(header, "attention.value_length_mla")),
        "first_k_dense_replace": int(header.arch_key("leading_dense_block_count") or 0),
        "attention_bias": False,
    }
    if experts:
        out.update({
            "n_routed_experts": int(experts),
            "num_experts_per_tok": int(_req(header, "expert_used_count")),
            "moe_intermediate_size": int(_req(header, "expert_feed_forward_length")),
            "n_shared_experts": int(header.arch_key("expert_shared_count") or 0),
            "routed_scaling_factor": float(header.arch_key("expert_weights_scale") or 1.0),
            "norm_topk_prob": bool(header.arch_key("expert_weights_norm") or False),
            "n_group": groups,
            "topk_group": int(header.arch_key("expert_group_used_count") or 1),
            "scoring_func": "sigmoid" if sigmoid else "softmax",
            # NOTE: what llama.cpp keeps of HF's topk_method: the bias means noaux_tc (V3), groups
            # without it V2's group_limited_greedy.
            "topk_method": "noaux_tc" if bias else ("group_limited_greedy" if groups > 1 else "greedy"),
        })
    else:  # no experts: Youtu's file (the converter's dense "deepseek2": every block a leading dense one)
        out.update(model_type="youtu", architectures=["YoutuForCausalLM"], n_routed_experts=None)
    # NOTE: the file keeps 0.1 * mscale_all_dim only; DeepSeek's configs set mscale equal to it
    # (then YaRN's cos/sin factor mscale / mscale_all_dim is 1), which is assumed here.
    extra = {}
    if (log_mul := header.arch_key("rope.scaling.yarn_log_multiplier")) is not None:
        m = float(log_mul) / 0.1
        extra = {"mscale": m, "mscale_all_dim": m}
    if (scaling := _yarn(header, **extra)) is not None:
        out["rope_scaling"] = scaling
    return out


def _gpt_oss(header) -> dict[str, Any]:
    layers = int(_req(header, "block_count"))
    out: dict[str, Any] = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "num_key_value_heads": int(_req(header, "attention.head_count_kv")),
        "head_dim": int(_req(header, "attention.key_length")),
        "intermediate_size": int(_req(header, "expert_feed_forward_length")),
        "num_local_experts": int(_req(header, "expert_count")),
        "num_experts_per_tok": int(_req(header, "expert_used_count")),
        "sliding_window": int(_req(header, "attention.sliding_window")),
        # NOTE: llama.cpp's gpt-oss: sliding window on even layers (HF's default layer_types)
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True,
    }
    scaling = _yarn(header, truncate=False)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def hf_name(architecture: str, gguf_name: str) -> str | None:
    """The HF (or stacked-expert) name of GGUF tensor `gguf_name`, or None if not mapped.
    `attn_k_b` / `attn_v_b` map to `...kv_b_proj.k_b` / `.v_b` (joined by `iter_weights`)."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, leaf = int(parts[1]), parts[2]
    prefix = f"model.layers.{layer}."
    if leaf in _EXPERTS:  # llama.cpp's merged name (`layers.moe.expert_param_name` maps it)
        return f"{prefix}{_EXPERTS[leaf]}.{suffix}"
    if architecture == "deepseek2":
        if leaf in ("attn_k_b", "attn_v_b"):
            return f"{prefix}self_attn.kv_b_proj.{leaf[5:]}"
        if leaf == "exp_probs_b":
            return prefix + "mlp.gate.e_score_correction_bias"
        mapped = _DEEPSEEK2.get(leaf)
    else:
        if leaf == "attn_sinks":
            return prefix + "self_attn.sinks"
        mapped = _GPT_OSS.get(leaf)
    return None if mapped is None else f"{prefix}{mapped}.{suffix}"


def iter_weights(header, config, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` for every tensor of the file (see `models.gguf_loader.iter_gguf_weights`):
    float32 in HF layout, or kept blocks (`keep_quantized`: the formats the kernel reads)."""
    arch = header.architecture
    names = {}
    for info in header.tensors:  # map everything first: fail before yielding anything
        if info.name in _SKIPPED:
            continue
        name = hf_name(arch, info.name)
        if name is None:
            raise ValueError(f"{header.path.name}: GGUF tensor {info.name!r} has no HF name for architecture {arch!r}")
        names[info.name] = name
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for info in header.tensors:
        name = names.get(info.name)
        if name is None:
            continue
        if name.endswith((".kv_b_proj.k_b", ".kv_b_proj.v_b")):
            # W_uk^T [H, r, nope] and W_uv [H, v, r]: dequantized (the layer absorbs them anyway)
            base, part = name.rsplit(".", 1)
            halves.setdefault(base, {})[part] = _read_tensor_f32(blob, info)
            if len(halves[base]) == 2:
                pair = halves.pop(base)
                yield f"{base}.weight", _join_kv_b(pair["k_b"], pair["v_b"], text)
            continue
        quantized = _read_quantized(blob, info) if keep_quantized else None
        if quantized is not None:
            yield name, quantized
            continue
        tensor = _read_tensor_f32(blob, info)
        if name.endswith(".e_score_correction_bias") or name.endswith(".sinks"):
            tensor = tensor.reshape(-1)
        yield name, tensor
    if halves:
        raise ValueError(f"{header.path.name}: attn_k_b without attn_v_b (or the reverse): {sorted(halves)}")


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor, config) -> torch.Tensor:
    """HF's `kv_b_proj.weight` `[H * (nope + v), r]` from llama.cpp's `attn_k_b` `[H, r, nope]`
    and `attn_v_b` `[H, v, r]`."""
    h, r, nope = k_b.shape
    if v_b.shape[0] != h or v_b.shape[2] != r or nope != config.qk_nope_head_dim:
        raise ValueError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not fit the config")
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(h * (nope + v_b.shape[1]), r)
