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

`decoder_layer_attn(...)` is the attention half alone (norm, projections, RoPE, K/V write,
attention, o, residual, the post-attention norm), for layers whose feed-forward runs apart: an MoE
block (`layers.moe.FusedMoE`, its experts in one call of `kernels.cpu_moe`). It returns the
residual `r` and the feed-forward's input `h`; the layer's output is `r + ff(h)`, bit-identical
to the modules'.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_fp32 import fp32_kernels_available
from pagedserve.kernels.cpu_gemm import MAX_M_FUSED, linear_isa
from pagedserve.kernels.cpu_qlinear import gemm_rows
from pagedserve.kernels.cpu_rotary import NORM_GEMMA, NORM_LLAMA

# the caches the fused layer writes and reads: bf16, or fp8 blocks (as kernels.cpu_attention's)
_CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

ACT_SILU, ACT_GELU_TANH = 0, 1

# The layer's norm_mode beyond kernels.cpu_rotary's NORM_GEMMA (sandwich norms, Gemma numerics)
# and NORM_LLAMA (pre-norms, Llama numerics): pre-norms with Gemma's numerics -- the fp32 weight
# multiplied before one rounding (`layers.norms.Fp32WeightRMSNorm`, gpt-oss)
NORM_PRE_FP32W = 3
NORM_MODES = (NORM_GEMMA, NORM_LLAMA, NORM_PRE_FP32W)


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


def _gemm_rows(weights: list[torch.Tensor], isa: int) -> list[int]:
    """Each weight's `gemm_rows` for bf16 x: its format's threshold, as the modules' products
    (`qlinear`) take it, so a projection runs the same kernel fused or not (0 for bf16 weights,
    whose kernel takes none)."""
    return [gemm_rows(getattr(w, "quant", None), torch.bfloat16, isa) for w in weights]


def _applies(x: torch.Tensor, tensors: tuple, caches: tuple, norm_mode: int,
             num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The ISA level for a fused call on these operands (`tensors`: bf16 or None; `caches`: the
    K and V caches), or 0: the call does not apply."""
    if norm_mode not in NORM_MODES:
        raise ValueError(f"norm_mode must be one of NORM_MODES {NORM_MODES}, got {norm_mode}")
    if not 0 < x.shape[0] <= MAX_M_FUSED:
        return 0
    isa = linear_isa()
    if not isa:  # disabled or unavailable
        return 0
    if head_dim % 32 or head_dim > 512 or num_heads % num_kv_heads or num_heads // num_kv_heads > 16:
        return 0
    for t in (x, *tensors):
        if t is not None and (t.dtype is not torch.bfloat16 or not t.is_cpu or not t.is_contiguous()):
            return 0
    # the KV caches: bf16, or fp8 blocks (kv_cache_dtype: converted when written, widened when read)
    k_cache = caches[0]
    if not all(c.dtype in _CACHE_DTYPES and c.dtype is k_cache.dtype and c.is_cpu
               and c.is_contiguous() for c in caches):
        return 0
    return isa


def decoder_layer(
    x: torch.Tensor,  # [T, H] bf16, one decode token per sequence
    weights: list[torch.Tensor],  # q, k, v, o, gate, up, down: bf16 [N, K] or quantized
    formats: list[int],  # their `weight_formats`
    biases: list[torch.Tensor | None],  # q, k, v, o
    norms: list[torch.Tensor | None],  # fp32 [H]/[D]: input, post-attn, pre-ff, post-ff, q, k
    norm_mode: int,  # NORM_GEMMA (sandwich norms), NORM_LLAMA (of kernels.cpu_rotary), NORM_PRE_FP32W
    eps: float,
    cos: torch.Tensor,  # [T, D] bf16
    sin: torch.Tensor,  # [T, D] bf16
    k_cache: torch.Tensor,  # [N, B, Hkv, D] bf16 or fp8, written at slot_mapping
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
    lora_tensors = () if lora is None else (*lora[1], *lora[2])
    isa = _applies(x, (cos, sin, *biases, *lora_tensors), (k_cache, v_cache), norm_mode,
                   num_heads, num_kv_heads, head_dim)
    if not isa:
        return None
    args = (x, weights, biases, norms, norm_mode, float(eps), cos, sin, k_cache, v_cache,
            slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads, head_dim, float(scale),
            int(window or 0), _act_code(act), formats, isa, _gemm_rows(weights, isa))
    if lora is None:
        return torch.ops.pagedserve_cpu.decoder_layer.default(*args)
    return torch.ops.pagedserve_cpu.decoder_layer_lora.default(*args, *lora)


def decoder_layer_attn(
    x: torch.Tensor,  # [T, H] bf16, one decode token per sequence
    weights: list[torch.Tensor],  # q, k, v, o: bf16 [N, K] or quantized
    formats: list[int],  # their `weight_formats`
    biases: list[torch.Tensor | None],  # q, k, v, o
    norms: list[torch.Tensor | None],  # fp32: input, post-attn, pre-ff, post-ff, q, k (as above)
    norm_mode: int,
    eps: float,
    cos: torch.Tensor,  # [T, D] bf16
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [N, B, Hkv, D] bf16 or fp8, written at slot_mapping
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [T, max_blocks] int64
    seq_lens: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,  # [Hq] sink logits (gpt-oss), or None
    whole_qk: bool = False,
    clip_qkv: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # r [T, H], h [T, H] bf16
    """The attention half of `decoder_layer` (see the module docstring): `(r, h)`, or None when
    the call does not apply. `sinks`: as `kernels.cpu_attention.decode_attention`'s (widened to
    float32 as it does). `whole_qk` (OLMoE): the q / k norms (`norms[4:]`, [Hq * D] / [Hkv * D])
    normalize the whole projections before the heads are split; `clip_qkv`: q, k, v clamped to
    [-clip_qkv, clip_qkv] after that."""
    isa = _applies(x, (cos, sin, *biases), (k_cache, v_cache), norm_mode, num_heads,
                   num_kv_heads, head_dim)
    if not isa:
        return None
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    r, h = torch.ops.pagedserve_cpu.decoder_layer_attn.default(
        x, weights, biases, norms, norm_mode, float(eps), cos, sin, k_cache, v_cache, slot_mapping,
        block_tables, seq_lens, num_heads, num_kv_heads, head_dim, float(scale), int(window or 0),
        formats, isa, _gemm_rows(weights, isa), sinks, bool(whole_qk), float(clip_qkv or 0.0))
    return r, h
