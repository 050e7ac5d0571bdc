"""A whole decoder layer in one compiled call for decode-only bf16 steps on CPU
(csrc/decoder_layer.cpp, part of the extension of kernels.cpu_gemm).

`decoder_layer(...)` runs the layer's norms, projections, q/k norm + RoPE, K/V write, paged decode
attention and gated MLP with the same kernels and ATen ops, in the same order, as the modules do
from Python -- so its result is bit-identical to theirs -- or returns None when it does not apply
(tensors not bf16/CPU/contiguous, more rows than MAX_M_FUSED, head sizes the kernels do not
handle, kernels disabled or unavailable), and the caller runs the modules; `weight_formats` checks
the weights, once per layer. At batch 1 the modules' Python (dispatch, wrapper checks, views: ~60
calls a layer) cost as much as the layer's small ops; one call removes it. Which layers may use it
is decided in `models.llama`.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_fp32 import fp32_kernels_available
from pagedserve.kernels.cpu_gemm import MAX_M_FUSED, linear_isa
from pagedserve.kernels.cpu_qlinear import gemm_rows
from pagedserve.kernels.cpu_rotary import NORM_GEMMA, NORM_LLAMA

ACT_SILU, ACT_GELU_TANH = 0, 1


def _act_code(act: int) -> int:
    """The kernel's activation code: torch's op (ACT_*), or + 2 for the fp32 extension's kernel.
    NOTE: exactly when `layers.activation.Activation` takes that kernel for bf16 x (its extension
    loaded), so that the fused layer stays bit for bit the modules."""
    return act + 2 if fp32_kernels_available() else act


def weight_formats(weights: list[torch.Tensor]) -> list[int] | None:
    """The kernel's format code of each weight (0: bf16; else its `QuantSpec`), or None when one
    cannot be taken (not a contiguous CPU tensor, neither bf16 nor quantized, rows in a permuted
    feature order). NOTE: a loaded model's weights keep their dtype and layout (loading copies in
    place), so callers compute this once per layer (models.llama's fused plan)."""
    formats = []
    for w in weights:
        spec = getattr(w, "quant", None)  # kernels.cpu_qlinear.QuantSpec
        if not (w.is_cpu and w.is_contiguous() and (spec is not None or w.dtype is torch.bfloat16)):
            return None
        if spec is not None and spec.perm is not None:  # x gathered first (GPTQ act-order)
            return None
        formats.append(spec.format.code if spec is not None else 0)
    return formats


def decoder_layer(
    x: torch.Tensor,  # [T, H] bf16, one decode token per sequence
    weights: list[torch.Tensor],  # q, k, v, o, gate, up, down: bf16 [N, K] or quantized
    formats: list[int],  # their `weight_formats`
    biases: list[torch.Tensor | None],  # q, k, v, o
    norms: list[torch.Tensor | None],  # fp32 [H]/[D]: input, post-attn, pre-ff, post-ff, q, k
    norm_mode: int,  # NORM_GEMMA (sandwich norms) or NORM_LLAMA (of kernels.cpu_rotary)
    eps: float,
    cos: torch.Tensor,  # [T, D] bf16
    sin: torch.Tensor,  # [T, D] bf16
    k_cache: torch.Tensor,  # [N, B, Hkv, D] bf16, written at slot_mapping
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [T, max_blocks] int64
    seq_lens: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int | None,
    act: int,
    lora: tuple | None = None,  # lora.layers.LoRAStacks.fused_operands(layer), or None
) -> torch.Tensor | None:  # [T, H] bf16
    """See the module docstring. With `lora` (the tokens' slots [T] int64, A^T per group, B^T
    per projection: bf16 contiguous CPU tensors or None, and r_max) each projection gets its
    tokens' adapters' low-rank products (csrc/lora_bgmv.cpp) added after its base product, as
    the LoRA hooks add them to the modules'."""
    if norm_mode not in (NORM_GEMMA, NORM_LLAMA):
        raise ValueError(f"norm_mode must be NORM_GEMMA or NORM_LLAMA, got {norm_mode}")
    if not 0 < x.shape[0] <= MAX_M_FUSED:
        return None
    isa = linear_isa()
    if not isa:  # disabled or unavailable
        return None
    if head_dim % 32 or head_dim > 512 or num_heads % num_kv_heads or num_heads // num_kv_heads > 16:
        return None
    lora_tensors = () if lora is None else (*lora[1], *lora[2])
    for t in (x, cos, sin, k_cache, v_cache, *biases, *lora_tensors):
        if t is not None and (t.dtype is not torch.bfloat16 or not t.is_cpu or not t.is_contiguous()):
            return None
    # a model's quantized weights share one policy (layers.quantization.set_batch_invariant)
    spec = next((s for s in (getattr(w, "quant", None) for w in weights) if s is not None), None)
    args = (x, weights, biases, norms, norm_mode, float(eps), cos, sin, k_cache, v_cache,
            slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads, head_dim, float(scale),
            int(window or 0), _act_code(act), formats, isa, gemm_rows(spec, torch.bfloat16, isa))
    if lora is None:
        return torch.ops.pagedserve_cpu.decoder_layer.default(*args)
    return torch.ops.pagedserve_cpu.decoder_layer_lora.default(*args, *lora)
