"""GGUF files of Qwen3-Next ("qwen3next") and Qwen3.5 ("qwen35", "qwen35moe"), written as
llama.cpp's converter writes them (conversion/qwen.py: norms as 1 + w, `ssm_a` = -exp(A_log),
the fused projections regrouped, Qwen3.5's value heads tiled, experts stacked), load into our
models equal to HF's (float32), and Q8_0 files keep the untouched projections as blocks."""

import gguf
import numpy as np
import pytest
import torch
import transformers

from moe_gguf import stack_experts
from pagedserve.layers.quantization import QuantizedTensor
from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
from pagedserve.models.loader import load_model
from utils import add_gguf_tensor, finish_gguf

VOCAB = 300
# llama.cpp writes the layer pattern as `full_attention_interval` (4 unless the config says)
TYPES = ["linear_attention"] * 3 + ["full_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, layer_types=TYPES, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONFIGS = {
    "qwen3next": lambda: transformers.Qwen3NextConfig(**COMMON, **MOE, intermediate_size=96),
    "qwen35": lambda: transformers.Qwen3_5TextConfig(**COMMON, intermediate_size=96),
    "qwen35moe": lambda: transformers.Qwen3_5MoeTextConfig(**COMMON, **MOE),
}


def _tile(t: torch.Tensor, dim: int, k_heads: int, per_k: int, size: int) -> torch.Tensor:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


def _split_gate_up(state: dict[str, torch.Tensor]):
    """transformers 5's in-memory experts (`experts.gate_up_proj` `[E, 2I, H]`, `down_proj`)
    as Qwen2MoeModel.modify_tensors splits and names them."""
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=-2)
            yield name[: -len("gate_up_proj")] + "gate_proj.weight", gate
            yield name[: -len("gate_up_proj")] + "up_proj.weight", up
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", t
        else:
            yield name, t


def _converted(arch: str, c, state: dict[str, torch.Tensor]):
    """(gguf-style HF name, tensor) pairs after the converter's modify_tensors."""
    nk, nv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    per_k, qk = nv // nk, 2 * nk * dk
    for name, t in _split_gate_up(stack_experts(state)):
        if arch != "qwen3next" and nk != nv and ".linear_attn." in name:  # _LinearAttentionVReorderBase
            if ".in_proj_qkv." in name or ".conv1d." in name:
                t = torch.cat([t[:qk], _tile(t[qk:], 0, nk, per_k, dv)])
            elif ".in_proj_z." in name:
                t = _tile(t, 0, nk, per_k, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
                t = _tile(t, 0, nk, per_k, 1)
            elif ".out_proj." in name:
                t = _tile(t, 1, nk, per_k, dv)
        if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name[: -len(".dt_bias")] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            g = t.reshape(nk, 2 * dk + 2 * per_k * dv, -1)
            q, k, v, z = g.split([dk, dk, per_k * dv, per_k * dv], dim=1)
            stem = name[: -len("in_proj_qkvz.weight")]
            yield stem + "in_proj_qkv.weight", torch.cat([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
            yield stem + "in_proj_z.weight", z.reshape(-1, t.shape[-1])
            continue
        yield name, t


def write_gguf(path, arch: str, hf_model, qtype=gguf.GGMLQuantizationType.F32):
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    if getattr(c, "intermediate_size", None):
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if arch != "qwen35":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * 0.25))
    if arch != "qwen3next":
        w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    for hf_name, t in _converted(arch, c, state):
        if hf_name.endswith(".A_log"):
            name = names.get_name(hf_name)  # `blk.N.ssm_a`: no suffix
        else:
            base, suffix = hf_name.rsplit(".", 1)
            name = f"{names.get_name(base)}.{suffix}"
        data = t.numpy().astype(np.float32)
        add_gguf_tensor(w, name, data, qtype, quantize="embed" not in hf_name and "norm" not in hf_name
                        and "conv1d" not in hf_name and data.shape[-1] % 32 == 0)
    finish_gguf(w)
    return path


def _load(path, tmp_path, keep_quantized=False):
    config = load_gguf_config(path, cache_dir=tmp_path / "cache")
    weights = iter_gguf_weights(path, config, keep_quantized=keep_quantized)
    dtype = torch.bfloat16 if keep_quantized else torch.float32
    return config, load_model(config, weights=weights, dtype=dtype, quantization="gguf" if keep_quantized else "none")


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_gguf_equals_the_hf_run(arch, hf_pair, check_hf, prompts, tmp_path):
    hf, ours_hf, _ = hf_pair(CONFIGS[arch](), std=0.15)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, hf)
    config, model = _load(path, tmp_path)
    assert type(model) is type(ours_hf)
    assert list(config.layer_types) == TYPES and config.linear_value_head_dim == 8
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_q8_0_gguf_keeps_untouched_projections_as_blocks(arch, hf_pair, tmp_path):
    hf, _, _ = hf_pair(CONFIGS[arch](), std=0.15)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, hf, gguf.GGMLQuantizationType.Q8_0)
    config = load_gguf_config(path, cache_dir=tmp_path / "cache")
    kept = {n for n, t in iter_gguf_weights(path, config, keep_quantized=True) if isinstance(t, QuantizedTensor)}
    assert "model.layers.3.self_attn.q_proj.weight" in kept
    assert "model.layers.0.mlp.experts.gate_proj.weight" in kept
    # Qwen3.5's value heads stay in llama.cpp's tiled order (the model runs in it): every
    # projection and the LM head stay blocks -- no bf16 copy of any of them
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight",
                 "model.layers.0.linear_attn.out_proj.weight", "lm_head.weight"):
        assert name in kept, name
    assert getattr(config, "linear_value_heads_tiled", False) == (arch == "qwen35moe")
    _, model = _load(path, tmp_path, keep_quantized=True)
    prompt = torch.tensor([[1, 5, 9, 30, 7, 2, 11]])
    from utils import PagedRunner

    ours = PagedRunner(model).step([(0, prompt[0].tolist())])[0]
    ref = hf(input_ids=prompt).logits[0]
    assert torch.isfinite(ours).all()
    assert torch.corrcoef(torch.stack([ours.flatten(), ref.flatten()]))[0, 1] > 0.98


def test_tiled_value_heads_refuse_tensor_parallelism():
    from pagedserve.distributed.tp import TPContext
    from pagedserve.layers.gated_delta_net import GatedDeltaNet

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        GatedDeltaNet(64, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4,
                      act="silu", eps=1e-6, page=64, tp=TPContext(0, 2), tiled=True)
