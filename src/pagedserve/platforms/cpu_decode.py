"""The CPU platform's fused decode fast path: a whole decoder layer as one compiled call
(`kernels.cpu_decoder_layer`, bit-identical to the layer's modules) on decode-only bf16 steps of
the torch attention backend on one rank. Models reach it through `layer.ops.decoder_layer`
(`models.llama.FusableDecoderLayer`); they import no kernel module. An MoE layer
(`models.mixtral.MoEDecoderLayer`) reaches its attention half through `layer.ops.decoder_attention`
(`fused_decode_attention`); its MoE block then runs from Python (the experts in one call,
`kernels.cpu_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.attention.backends.torch_meta import TorchAttentionMetadata
from pagedserve.kernels.cpu_decoder_layer import (
    ACT_GELU_TANH, ACT_SILU, NORM_PRE_FP32W, decoder_layer, decoder_layer_attn, weight_formats)
from pagedserve.kernels.cpu_rotary import NORM_GEMMA, NORM_LLAMA

# HF activation names -> the fused layer's activation codes
FUSED_ACTS = {
    "silu": ACT_SILU, "swish": ACT_SILU,
    "gelu_pytorch_tanh": ACT_GELU_TANH, "gelu_new": ACT_GELU_TANH, "gelu_fast": ACT_GELU_TANH,
    "gelu_python_tanh": ACT_GELU_TANH,
}
_MODES = {"llama": NORM_LLAMA, "gemma": NORM_GEMMA}


@dataclass
class _FusedPlan:
    """What one layer passes to the fused decode call, gathered once (about 40 module attribute
    lookups a layer otherwise, every step). `usable` is False for layers the kernel cannot run."""

    usable: bool
    weights: list  # q, k, v, o, gate, up, down Parameters (q, k, v, o: `attn_only`)
    formats: list | None  # their kernel format codes (kernels.cpu_decoder_layer.weight_formats)
    biases: list  # q, k, v, o Parameters or None
    norms: tuple  # input, post-attn, pre-ff, post-ff, q, k norm modules or None
    norm_weights: list  # the present norms' weight Parameters
    mode: int  # the layer's structure: NORM_GEMMA (sandwich norms) or NORM_LLAMA (pre-norms)
    consts: tuple  # num_heads, num_kv_heads, head_dim, scale, sliding_window, activation code
    sinks: torch.Tensor | None  # the attention's sink logits (gpt-oss) or None
    whole_qk: bool  # the q/k norms span the whole projections (OLMoE)
    clip_qkv: float | None  # q, k, v clamped to +-clip_qkv after them (OLMoE), or None
    # (the norm weights' (data_ptr, version) when built, ([fp32 weight or None] x 6, eps,
    # numerics) or None)
    norm_cache: tuple | None = None


def _fused_plan(layer, attn_only: bool = False) -> _FusedPlan:
    """The layer's plan, built on first use. `attn_only`: the attention half alone (the layer's
    feed-forward runs apart: no MLP weights or activation needed)."""
    # NOTE: holds the Parameter objects themselves: loading weights copies into them in place and
    # `.to()` swaps their data, so the plan stays valid; a Parameter *replaced* by assignment
    # would not be seen (nothing in pagedserve does that to a decoder layer).
    plan = layer.__dict__.get("_fused_plan")
    if plan is None:
        attn, mlp, norms = layer.self_attn, layer.mlp, layer.layer_norms()
        all_norms = (*norms, attn.q_norm, attn.k_norm)
        weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]
        if attn_only:
            act = ACT_SILU  # unused by the attention half
        else:
            weights += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
            act = None if mlp.mlp_bias else FUSED_ACTS.get(mlp.act_name)
        formats = weight_formats(weights)
        # NOTE: the kernel neither caps scores (Gemma 2) nor rotates pairs (GLM-4; whose
        # sandwich norms have Llama numerics, which norm_mode cannot say either), and knows no
        # residual multiplier (Granite: an at::mul(o, rm) before each residual add in
        # csrc/decoder_layer.cpp would be the modules' op), nor partial RoPE (Phi-4-mini: the
        # check on the rope width below): such layers run their modules. OLMo 2's layer is not
        # a fusable one (post-norms, whole-projection q/k norms).
        sinks = getattr(attn, "sinks", None)
        whole_qk = bool(getattr(attn, "whole_projection_qk_norm", False))
        clip_qkv = getattr(attn, "clip_qkv", None)
        # (the whole layer's call takes none of the attention half's options)
        extras = sinks is not None or whole_qk or clip_qkv is not None
        usable = not (formats is None or act is None or attn.o_proj.tp.is_parallel
                      or (not attn_only and extras)
                      or (not attn_only and mlp.down_proj.tp.is_parallel)
                      or attn.attn.softcap is not None
                      or getattr(attn, "rope_interleaved", False)
                      or getattr(layer, "residual_multiplier", 1.0) != 1.0)
        plan = _FusedPlan(
            usable, weights, formats,
            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias],
            all_norms,
            [m.weight for m in all_norms if m is not None],
            NORM_GEMMA if norms[2] is not None else NORM_LLAMA,
            (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale,
             attn.attn.sliding_window, act),
            sinks, whole_qk, clip_qkv,
        )
        layer.__dict__["_fused_plan"] = plan
    return plan


def _norm_args(plan: _FusedPlan) -> tuple[list, float, int] | None:
    """The norms' fp32 weights (None where absent), eps and their numerics (NORM_LLAMA or
    NORM_GEMMA) for the fused call, rebuilt only when a norm weight changes; None when a norm is
    one the kernels do not take, or eps / numerics are mixed."""
    key = tuple((w.data_ptr(), w._version) for w in plan.norm_weights)
    if plan.norm_cache is None or plan.norm_cache[0] != key:
        args = [None if m is None else m.kernel_args(torch.bfloat16) for m in plan.norms]
        present = [a for a, m in zip(args, plan.norms) if m is not None]
        ok = all(a is not None for a in present) and len({a[1:] for a in present}) == 1
        ok = ok and present[0][2] in _MODES
        value = ([None if a is None else a[0] for a in args], present[0][1],
                 _MODES[present[0][2]]) if ok else None
        plan.norm_cache = (key, value)
    return plan.norm_cache[1]


def _fusable_step(x: torch.Tensor, meta) -> bool:
    """A bf16 CPU step of the torch backend whose one KV group covers every layer (the fused
    calls' preconditions on the step; the layer's are its plan's): its metadata is the torch
    backend's, with one decode group over the whole batch, which the fused calls read."""
    return (x.dtype is torch.bfloat16 and x.is_cpu and isinstance(meta, TorchAttentionMetadata)
            and len(meta.groups) == 1 and meta.groups[0].covers_all)


def fused_decode_layer(layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache,
                       meta) -> torch.Tensor | None:  # [T, H]
    """`layer` (a `models.llama.FusableDecoderLayer`) in one compiled call on a decode-only bf16
    CPU step of the torch backend on one rank; None elsewhere.

    NOTE: the fused call bypasses the submodules' forward hooks (the profiler's attention hook
    among them): decode attention then counts as "forward (rest)". The LoRA hooks' products
    (`lora.layers`) it adds itself, on a step with adapters.
    """
    if not _fusable_step(x, meta):
        return None
    stacks = layer.__dict__.get("lora_stacks")  # lora.layers.LoRAStacks (engine's enable_lora)
    lora = None
    if stacks is not None and stacks.mapping is not None:  # a step with adapters: the call
        lora = stacks.fused_operands(layer.__dict__["lora_index"])  # adds them (hooks bypassed)
        if lora is None:
            return None  # no per-token kernels for them: the hooked modules
    plan = _fused_plan(layer)
    if not plan.usable or rope[0].shape[-1] != plan.consts[2]:  # partial RoPE: the modules
        return None
    norm_args = _norm_args(plan)
    if norm_args is None or norm_args[2] != plan.mode:
        return None
    group = meta.groups[0]
    return decoder_layer(
        x, plan.weights, plan.formats, plan.biases, norm_args[0], plan.mode, norm_args[1],
        *rope, *kv_cache, meta.slot_mapping, group.block_tables, group.seq_lens, *plan.consts,
        lora=lora,
    )


def fused_decode_attention(layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache,
                           meta) -> tuple[torch.Tensor, torch.Tensor] | None:  # r, h [T, H]
    """The attention half of `layer` (a `models.mixtral.MoEDecoderLayer` with Llama's or OLMoE's
    attention -- whole-projection q/k norms, clip_qkv --, or `models.gpt_oss.GptOssDecoderLayer`:
    pre-norms of Llama or fp32-weight numerics, sinks) in one compiled call on a decode-only
    bf16 CPU step of the torch backend on one rank: `(r, h)` = (x + attention, the
    post-attention norm of that), the layer's output being `r + layer.mlp(h)`; None elsewhere
    (and on a step with LoRA adapters: the hooked modules add them). Bypasses the submodules'
    forward hooks as `fused_decode_layer` does."""
    if not _fusable_step(x, meta):
        return None
    stacks = layer.__dict__.get("lora_stacks")
    if stacks is not None and stacks.mapping is not None:
        return None
    plan = _fused_plan(layer, attn_only=True)
    if not plan.usable or plan.mode != NORM_LLAMA or rope[0].shape[-1] != plan.consts[2]:
        return None
    norm_args = _norm_args(plan)
    if norm_args is None:
        return None
    mode = NORM_LLAMA if norm_args[2] == NORM_LLAMA else NORM_PRE_FP32W  # pre-norms either way
    group = meta.groups[0]
    return decoder_layer_attn(
        x, plan.weights, plan.formats, plan.biases, norm_args[0], mode, norm_args[1],
        *rope, *kv_cache, meta.slot_mapping, group.block_tables, group.seq_lens, *plan.consts[:5],
        sinks=plan.sinks, whole_qk=plan.whole_qk, clip_qkv=plan.clip_qkv,
    )
