"""Tiny MoE GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them, and the checks
the MoE family tests share (HF folder vs GGUF, kept quantized).

llama.cpp merges each layer's experts into 3-D tensors `blk.N.ffn_{gate,up,down}_exps.weight`
(torch shape `[E, out, in]`), names the router `ffn_gate_inp` (always F32), the shared expert
`ffn_*_shexp` and its gate `ffn_gate_inp_shexp`, and stores `expert_count`, `expert_used_count`,
`expert_feed_forward_length`, `expert_shared_feed_forward_length` (and `attention.clamp_kqv`).
Mixtral is architecture "llama" (Q/K rows permuted), with the experts; Phi-3.5-MoE "phimoe", its
LongRoPE as Phi-3's converter writes it (`_phimoe_keys`); Llama 4 "llama4", its fused experts
split and its Llama 3 RoPE as the `rope_freqs` tensor (`_llama4_keys`); MiniMax-M2 "minimax-m2",
its rotated part as `rope.dimension_count`; HunYuan MoE "hunyuan-moe", its NTK-alpha RoPE as the
scaled `rope.freq_base`.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
from pagedserve.models.loader import load_model

ARCHS = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
         "granitemoe": gguf.MODEL_ARCH.GRANITE_MOE, "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE,
         "ernie4_5_moe": gguf.MODEL_ARCH.ERNIE4_5_MOE, "lfm2_moe": gguf.MODEL_ARCH.LFM2MOE,
         "phimoe": gguf.MODEL_ARCH.PHIMOE, "llama4": gguf.MODEL_ARCH.LLAMA4,
         "minimax_m2": gguf.MODEL_ARCH.MINIMAXM2, "hunyuan_v1_moe": gguf.MODEL_ARCH.HUNYUAN_MOE}
ARCHS["afmoe"] = gguf.MODEL_ARCH.AFMOE
ARCHS["exaone_moe"] = gguf.MODEL_ARCH.EXAONE_MOE
# (the installed gguf package predates "cohere2moe": its name and, for the tensor names, an
# architecture with the same tensors)
ARCH_NAMES = {"cohere2_moe": "cohere2moe"}
ARCHS["dbrx"] = gguf.MODEL_ARCH.DBRX
ARCHS["cohere2_moe"] = getattr(gguf.MODEL_ARCH, "COHERE2MOE", gguf.MODEL_ARCH.GLM4_MOE)
_PERMUTED = ("mixtral", "granitemoe")  # llama.cpp's LlamaModel subclasses: Q/K rows permuted
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's per-expert tensors merged into one `[E, out, in]` tensor per layer and projection,
    named `<prefix>.experts.<leaf>.weight`, as the converter does."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
    for name, parts in groups.items():
        out[name] = torch.stack([parts[i] for i in range(len(parts))])
    return out


def split_granite(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Granite MoE's fused tensors split as its converter splits them (conversion/granite.py):
    `block_sparse_moe.input_linear` `[E, 2I, H]` into the gate / up expert stacks (named here
    `<prefix>.experts.<leaf>.weight`, as the other families' stacks, and written below as
    `ffn_{gate,up,down}_exps`), `shared_mlp.input_linear` `[2S, H]` into the shared gate / up."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".block_sparse_moe.input_linear.weight"):
            stem = name[: -len("input_linear.weight")]
            gate, up = t.split(config.intermediate_size, dim=-2)
            out[f"{stem}experts.gate_proj.weight"], out[f"{stem}experts.up_proj.weight"] = gate, up
        elif name.endswith(".block_sparse_moe.output_linear.weight"):
            out[name[: -len("output_linear.weight")] + "experts.down_proj.weight"] = t
        elif name.endswith(".shared_mlp.input_linear.weight"):
            stem = name[: -len("input_linear.weight")]
            gate, up = t.split(config.shared_intermediate_size, dim=-2)
            out[f"{stem}shared_gate.weight"], out[f"{stem}shared_up.weight"] = gate, up
        else:
            out[name] = t
    return out


_GRANITE_SPLIT = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe\.experts\.(gate|up|down)_proj|"
                            r"shared_mlp\.shared_(gate|up))$")


def _gguf_name(name_map, hf_base: str) -> str | None:
    m = _GRANITE_SPLIT.match(hf_base)
    if m is None:
        return name_map.get_name(hf_base)
    leaf = f"ffn_{m[3]}_exps" if m[3] else f"ffn_{m[4]}_shexp"
    return f"blk.{m[1]}.{leaf}"


def _phimoe_keys(writer: gguf.GGUFWriter, config, head_dim: int) -> None:
    """What conversion/phi.py's Phi3MiniModel adds for Phi-3.5-MoE: the sliding window (0: none),
    the original context, and with LongRoPE the factors as two tensors and its own attention
    factor (not the config's mscales)."""
    import math

    from pagedserve.layers.rotary import rope_parameters

    rope = rope_parameters(config)
    original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope["rope_type"] != "longrope":
        return
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    assert len(rope["long_factor"]) == head_dim // 2
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def split_llama4(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Llama 4's fused experts as conversion/llama.py's Llama4Model splits them:
    `experts.gate_up_proj` `[E, H, 2I]` -> `experts.gate_proj` / `up_proj` `[E, I, H]`,
    `experts.down_proj` `[E, I, H]` -> `[E, H, I]` (named `<prefix>.experts.<leaf>.weight`)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            gate, up = t.transpose(-1, -2).split(t.shape[-1] // 2, dim=-2)
            stem = name[: -len("gate_up_proj")]
            out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = gate, up
        elif name.endswith(".experts.down_proj"):
            out[name + ".weight"] = t.transpose(-1, -2)
        else:
            out[name] = t
    return out


def _llama4_keys(writer: gguf.GGUFWriter, config, head_dim: int) -> None:
    """What conversion/llama.py's LlamaModel and Llama4Model add: the vocabulary size, the
    experts' width and interleave step, and Llama 3's RoPE as per-frequency divisors
    (`rope_freqs`, its generate_extra_tensors)."""
    import math

    from pagedserve.layers.rotary import rope_parameters

    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_interleave_moe_layer_step(config.interleave_moe_layer_step)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    rope = rope_parameters(config)
    if rope["rope_type"] != "llama3":
        return
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old, low, high = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                      rope["high_freq_factor"])
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def _afmoe_keys(writer: gguf.GGUFWriter, config, head_dim: int) -> None:
    """What conversion/afmoe.py's AfmoeModel (and LlamaModel) add."""
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_expert_shared_count(config.num_shared_experts)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_leading_dense_block_count(config.num_dense_layers)
    writer.add_expert_weights_norm(bool(getattr(config, "route_norm", True)))
    writer.add_expert_weights_scale(config.route_scale)
    writer.add_sliding_window(config.sliding_window)


def _exaone_moe_keys(writer: gguf.GGUFWriter, config) -> None:
    """What conversion/exaone.py's ExaoneMoEModel (and Exaone4Model) add."""
    writer.add_vocab_size(config.vocab_size)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.num_shared_experts)
    writer.add_expert_shared_feed_forward_length(config.moe_intermediate_size * config.num_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_nextn_predict_layers(0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _cohere2_moe_keys(writer: gguf.GGUFWriter, config, head_dim: int) -> None:
    """What conversion/command_r.py's Cohere2MoeModel (and the base's gating function) add."""
    dense = [t == "dense" for t in config.mlp_layer_types]
    writer.add_logit_scale(config.logit_scale)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_leading_dense_block_count(dense.index(False) if False in dense else len(dense))
    writer.add_expert_weights_norm(config.norm_topk_prob)
    if config.num_shared_experts:
        writer.add_expert_shared_count(config.num_shared_experts)
        writer.add_expert_shared_feed_forward_length(config.intermediate_size * config.num_shared_experts)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if config.expert_selection_fn == "softmax"
                                  else gguf.ExpertGatingFuncType.SIGMOID)


def write_moe_gguf(path: Path, family: str, config, state: dict[str, torch.Tensor], *,
                   types: dict[str, gguf.GGMLQuantizationType] | None = None, extra=None) -> Path:
    """`state` (HF names) as llama.cpp's converter writes the family; `types` picks a storage
    type per substring of the HF name (first match; default F32); `extra(writer)` adds keys."""
    arch = ARCHS[family]
    writer = gguf.GGUFWriter(str(path), ARCH_NAMES.get(family) or gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    # GLM-4.5's converter counts its multi-token-prediction layers in (none in a tiny checkpoint)
    nextn = getattr(config, "num_nextn_predict_layers", 0) if family == "glm4_moe" else 0
    writer.add_block_count(config.num_hidden_layers + nextn)
    # (Llama 4's converter writes the dense layers' width here, the experts' below)
    if family == "cohere2_moe":  # (its converter: the dense prefix's width first)
        writer.add_feed_forward_length(config.prefix_dense_intermediate_size or config.intermediate_size)
    elif family == "llama4" or hasattr(config, "intermediate_size"):  # (Solar Open's converter writes none)
        writer.add_feed_forward_length(config.intermediate_size_mlp if family == "llama4" else config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if family == "lfm2_moe":  # conversion/lfm2.py's LFM2MoeModel: KV heads per layer (0: conv)
        writer.add_head_count_kv([config.num_key_value_heads if t == "full_attention" else 0
                                  for t in config.layer_types])
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_leading_dense_block_count(config.num_dense_layers)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_vocab_size(config.vocab_size)
        writer.add_shortconv_l_cache(config.conv_L_cache)
    elif family == "dbrx" or (family == "cohere2_moe" and config.rms_norm_eps is None):  # (LayerNorms)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_eps(getattr(config, "layer_norm_eps", 1e-5))
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    from pagedserve.layers.rotary import rope_parameters

    if family == "hunyuan_v1_moe":  # conversion/hunyuan.py: the NTK-alpha base, no scaling
        from pagedserve.models.hunyuan import hunyuan_rope_parameters

        writer.add_rope_freq_base(float(hunyuan_rope_parameters(config)["rope_theta"]))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1)
    else:
        writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if family == "llama4":
        _llama4_keys(writer, config, head_dim)
        state = split_llama4(state)
    elif family in _PERMUTED or family == "phimoe":
        writer.add_rope_dimension_count(head_dim)
    elif family in ("glm4_moe", "ernie4_5_moe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if family == "glm4_moe":
            writer.add_rope_dimension_count(int(head_dim * rope_parameters(config).get("partial_rotary_factor", 0.5)))
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if family == "olmoe" and config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)
    if family == "glm4_moe":  # conversion/glm.py's Glm4MoeModel and the base's expert keys
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        if (dense := getattr(config, "first_k_dense_replace", None)) is not None:  # (Solar Open: none)
            writer.add_leading_dense_block_count(dense)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_nextn_predict_layers(nextn)
    if family == "ernie4_5_moe":  # conversion/ernie.py's Ernie4_5MoeModel
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.moe_num_shared_experts)
    if family == "hunyuan_v1_moe":  # conversion/hunyuan.py's HunYuanMoEModel
        writer.add_expert_shared_feed_forward_length(config.intermediate_size)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_expert_shared_count(1)
    if family == "phimoe":
        _phimoe_keys(writer, config, head_dim)
    if family == "minimax_m2":  # conversion/minimax.py's MiniMaxM2Model (and the base's scoring_func)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_dimension_count(int(head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0)))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family == "granitemoe":
        writer.add_vocab_size(config.vocab_size)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
        if getattr(config, "shared_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
        state = split_granite(state, config)
    if family == "afmoe":  # conversion/afmoe.py (a LlamaModel: its rope dims and vocabulary)
        _afmoe_keys(writer, config, head_dim)
    if family == "exaone_moe":
        _exaone_moe_keys(writer, config)
    if family == "cohere2_moe":
        _cohere2_moe_keys(writer, config, head_dim)
    if family == "dbrx":  # conversion/dbrx.py (the experts' width as feed_forward_length)
        writer.add_clamp_kqv(config.attn_config.clip_qkv)
    if extra is not None:
        extra(writer)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in stack_experts(state).items():
        base, suffix = hf_name.rsplit(".", 1)
        if suffix == "e_score_correction_bias":  # the converter's exp_probs_b.bias
            base, suffix = f"{base}.e_score_correction", "bias"
        if suffix == "expert_bias":  # LFM2-MoE's (a buffer): the converter's exp_probs_b.bias
            base, suffix = f"{base}.expert_bias", "bias"
        if family == "lfm2_moe" and ".experts." in base:  # merged as `layers.N...` (no model.)
            base = base.removeprefix("model.")
        mapped = _gguf_name(name_map, base)
        assert mapped is not None, hf_name
        gguf_name = f"{mapped}.{suffix}"
        data = tensor.detach().float().numpy()
        if family == "lfm2_moe" and hf_name.endswith("conv.conv.weight"):
            data = data.squeeze(1)  # [C, L], as the converter writes it
        if family in _PERMUTED and ".q_proj." in hf_name:
            data = _permute(data, config.num_attention_heads)
        if family in _PERMUTED and ".k_proj." in hf_name:
            data = _permute(data, config.num_key_value_heads)
        qtype = next((t for key, t in (types or {}).items() if key in hf_name), gguf.GGMLQuantizationType.F32)
        if data.ndim == 1 or "ffn_gate_inp" in gguf_name:
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


def load_gguf_model(path: Path, cache: Path, *, quantized: bool, dtype=torch.float32, max_model_len=None):
    """Our model from the GGUF file, its ggml blocks kept (`quantized`) or dequantized."""
    config = load_gguf_config(path, cache_dir=cache)
    weights = iter_gguf_weights(path, config, keep_quantized=quantized)
    return load_model(config, weights=weights, dtype=dtype, quantization="gguf" if quantized else "none",
                      max_model_len=max_model_len)


def check_gguf_family(family: str, hf_model, folder: Path, tmp_path: Path, prompts, check_hf, *,
                      max_model_len: int | None = None, loads_as: str | None = None) -> None:
    """The family from a GGUF file converted from the HF `folder` (its safetensors, as the
    converter reads them): F32 tensors give HF's logits (`check_hf`); Q8_0 experts kept as their
    stacked blocks (no float copy) give HF's greedy tokens by the tie rule. `max_model_len`: the
    context served (LongRoPE's choice of factors)."""
    from pagedserve.models.loader import iter_safetensors

    config = hf_model.config
    state = dict(iter_safetensors(folder))
    f32 = write_moe_gguf(tmp_path / f"{family}-f32.gguf", family, config, state)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False, max_model_len=max_model_len)
    assert type(model).__name__ == (loads_as or config.architectures[0])  # (loads_as: written as another family)
    check_hf(hf_model, model, prompts)

    Q = gguf.GGMLQuantizationType
    q8 = write_moe_gguf(tmp_path / f"{family}-q8.gguf", family, config, state,
                        types={".experts.": Q.Q8_0, "_proj": Q.F16})
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16,
                            max_model_len=max_model_len)
    experts = model.model.layers[-1].mlp.experts
    assert experts.gate_proj.dtype == torch.uint8 and experts.gate_proj.quant.format.name == "q8_0"
    assert experts.down_proj.dim() == 3  # stacked blocks [E, H, row_bytes]
    check_greedy_tie_rule(hf_model, model, prompts[:2], f"{family} Q8_0")


def check_greedy_tie_rule(hf_model, model, prompts, what: str, steps: int = 6) -> None:
    """Our greedy tokens (top-5 logprobs) for each prompt equal HF's by the tie rule."""
    from utils import PagedRunner, assert_tie_rule, hf_greedy

    for i, prompt in enumerate(prompts):
        ref = hf_greedy(hf_model, prompt, steps)
        runner, seq, toks, lps = PagedRunner(model), list(prompt), [], []
        logits = runner.step([(0, seq)])[0][-1]
        for _ in range(steps):
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            vals, idx = torch.topk(lp, 5)
            toks.append(tok)
            lps.append({**dict(zip(idx.tolist(), vals.tolist())), tok: float(lp[tok])})
            logits = runner.step([(0, [tok])])[0][-1]
        assert_tie_rule((toks, lps), ref, f"{what} prompt {i}")
