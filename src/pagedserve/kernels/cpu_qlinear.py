"""Linear layers over bf16 or quantized weights, on the compiled kernel (csrc/qlinear.cpp).

A quantized weight is a uint8 tensor `[N, row_bytes]` holding each output row's blocks exactly as
the format lays them out (GGUF's ggml blocks, or our INT8 rows: an fp32 scale then K int8), with a
`QuantSpec` attached as its `quant` attribute (`set_quant`); `kernels.cpu_gemm.bf16_linear` routes
such weights here.

The formats are the rows of csrc/qformats.h (`FORMATS`, read from it).

- DOT8 formats (ggml's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4; Q4_Z / Q8_F, the HF
  checkpoints' AWQ / GPTQ / compressed-tensors weights of `layers.hf_quant`), at every ISA level: as llama.cpp does,
  each row of x is quantized to 8-bit blocks of 32 (scale amax / 127, fp32) and multiplied with
  the weight blocks as stored, by AVX2 integer dot products, one fp32 FMA per block
  (csrc/qlinear_q8.h; on AVX512-BF16 / AMX CPUs the same operations with two blocks per VNNI
  vpdpbusd, csrc/qlinear_q8_vnni.h: the same bits). So the result carries the activations' rounding (at most half a step of
  their block per value), as llama.cpp's does, also for float32 x.
  From `gemm_rows` rows of x on (bf16 x, outside the batch-invariant mode) a blocked GEMM takes
  over: 16 weight rows unpacked once, every row of x over them -- the 8-bit GEMMs on AVX2
  (csrc/qlinear_q8_gemm.h) and AVX512-BF16 (csrc/qlinear_vnni.h, Q6_K's halves summed apart), AMX tiles.
- bf16 and INT8 weights: 16 rows of W at a time are dequantized into a buffer in L1/L2 and every
  row of x is multiplied by them (AMX, AVX512-BF16, AVX512F or AVX2 FMA: `kernels.cpu_isa`).

Either way each weight byte is read once per product (for a tile of rows of x). Within one
kernel a row's result does not depend on the other rows of the batch; which kernel runs depends
on the batch's row count unless the weight is marked batch-invariant (`QuantSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.build import quant_formats
from pagedserve.kernels.cpu_gemm import linear_isa
from pagedserve.kernels.cpu_isa import ISA_AMX, ISA_AVX2, ISA_AVX512, ISA_AVX512BF16, ISA_NONE


@dataclass(frozen=True)
class QuantFormat:
    """A weight format, one row of csrc/qformats.h: its code for the kernel, values per block,
    bytes per block, bytes before a row's blocks (`head`: INT8's scale), its kernel ("DOT8": 8-bit
    x times the stored blocks; "DENSE": rows dequantized), the GEMM it takes from `gemm_rows`
    rows on ("NONE": the 8-bit kernel at every row count) and its GGUF type name ("" for none)."""

    name: str
    code: int
    block: int
    block_bytes: int
    head: int = 0
    kernel: str = "DOT8"
    gemm: str = "Q8"
    ggml: str = ""

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k values; ValueError if k is not whole blocks."""
        if k % self.block:
            raise ValueError(f"{self.name} rows need a multiple of {self.block} values, got {k}")
        return self.head + k // self.block * self.block_bytes


# NOTE: generated from the one table (csrc/qformats.h, parsed by kernels.build.quant_formats): a
# new format is a row there, never an entry here.
FORMATS = {
    r.name: QuantFormat(r.name, r.code, r.block, r.block_bytes, r.head, r.kernel, r.gemm, r.ggml)
    for r in quant_formats()
}

# ggml type names (gguf.GGMLQuantizationType) the kernel takes as they are
GGML_FORMATS = {f.ggml: f.name for f in FORMATS.values() if f.ggml}


@dataclass(frozen=True)
class QuantSpec:
    """What a quantized weight tensor holds: `format` rows of `in_features` values; `dtype` is
    the activation dtype of the model it serves (embedding lookups return it).

    `batch_invariant`: ggml-format products always run the 8-bit-activation kernel, so a row's
    result never depends on its batch; otherwise bf16 products of `gemm_rows(isa)` rows or more
    run the blocked GEMM (see `gemm_rows`).

    `int8_activations` (ggml formats): False multiplies x as it is (bf16 or fp32) with the
    blocks dequantized 16 rows at a time, for every row count (batch-invariant too): what the
    dequantized checkpoint computes, without its memory; True (default): llama.cpp's numerics,
    x quantized to 8-bit blocks, faster.

    `perm` (int64 `[in_features]` or None): the rows hold the input features in this order (GPTQ
    act-order, `layers.hf_quant`); products gather x's features in it first. An MoE layer's
    stack `[E, N, row_bytes]` has `[E, in_features]`: each expert's order (`kernels.cpu_moe`;
    `layers.moe.MoEExperts.expert_weight` hands one expert's row to its products)."""

    format: QuantFormat
    in_features: int
    dtype: torch.dtype = torch.bfloat16
    batch_invariant: bool = False
    int8_activations: bool = True
    perm: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`qlinear(x, weight, bias, out_dtype)` for a weight carrying this spec: how
        `kernels.cpu_gemm.bf16_linear` routes it (cpu_gemm sits below this module)."""
        return qlinear(x, weight, bias, out_dtype)


# Rows of x from which a bf16 product over ggml blocks runs the blocked GEMM (16 weight rows
# unpacked once, every row of x over them: the 8-bit GEMMs of csrc/qlinear_q8_gemm.h on AVX2 and
# csrc/qlinear_vnni.h on AVX512-BF16, dequantized bf16 / fp32 otherwise) instead of the
# small-batch kernel on the stored blocks, per ISA level: measured on Gemma 3 270M's shapes
# (docs/benchmarks.md, "Kernels chosen by shape"). NOTE: the kernels sum in different orders (or
# round differently), so with a threshold a row's bits depend on its batch's size;
# `QuantSpec.batch_invariant` turns it off.
GEMM_ROWS = {ISA_AVX2: 8, ISA_AVX512: 24, ISA_AVX512BF16: 8, ISA_AMX: 8}

# Per-format thresholds where they were measured to differ from the level's (`scripts/bench_qgemm.py
# --m 4,5,6,7,8,9,10,12`, the embedded Gemma 3's and the MoE bench model's shapes; docs/benchmarks.md,
# "The GEMM's row threshold per format"): on AVX512-BF16 the GEMM is ahead from 6 rows on Q8_0 /
# Q5_0 (1.1-1.5x at 6-7), while on Q4_K / Q6_K the small-batch VNNI kernel keeps up to 8 rows.
# On AMX (2026-12-07, Intel Xeon, `--isas amx --m 3,4,5,6,7,8`) the tile GEMM is ahead from 5 rows
# on Q8_0 / Q5_0 (1.1-1.5x at 5-7: the LM head at 7 rows 129 -> 190 GFLOP/s; a 7-row decode step
# in process 35.5 -> 28.7 ms), level with the 8-bit kernel at 8 rows on Q4_K / Q6_K.
# Levels not measured keep `GEMM_ROWS`.
# NOTE: a layer's projections may then run different kernels in one step (the fused decode
# layer passes one threshold per weight, `kernels.cpu_decoder_layer`).
GEMM_ROWS_BY_FORMAT = {ISA_AVX512BF16: {"q8_0": 6, "q5_0": 6, "q4_k": 9, "q6_k": 9},
                       ISA_AMX: {"q8_0": 5, "q5_0": 5, "q4_k": 8, "q6_k": 8}}


def gemm_rows(spec: QuantSpec | None, x_dtype: torch.dtype, isa: int) -> int:
    """The kernel's `gemm_rows` argument for a product with x of `x_dtype` at ISA `isa` (the
    format's threshold, `GEMM_ROWS_BY_FORMAT`, else the level's, `GEMM_ROWS`): 0 (never
    the GEMM) for plain weights, batch-invariant specs and float32 x (NOTE: float32 stays
    batch-invariant always: the engine's exactness guarantees are stated in float32); -1 (no
    8-bit x at all: dequantized blocks times x) for specs without `int8_activations`."""
    if spec is not None and not spec.int8_activations:
        return -1
    if (spec is None or spec.batch_invariant or x_dtype is not torch.bfloat16
            or spec.format.gemm == "NONE"):  # its row takes no GEMM (MXFP4): the 8-bit kernel only
        return 0
    return GEMM_ROWS_BY_FORMAT.get(isa, {}).get(spec.format.name, GEMM_ROWS.get(isa, 0))


def set_quant(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Mark `weight` (uint8 `[N, row_bytes]`, or `[E, N, row_bytes]`: an MoE layer's stacked
    experts, each `weight[e]` a weight of `spec`) as holding `spec`; returns it. ValueError if
    the bytes do not match."""
    if weight.dtype != torch.uint8 or weight.dim() not in (2, 3):
        raise ValueError(f"a quantized weight is a 2-D (or stacked 3-D) uint8 tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    want = spec.format.row_bytes(spec.in_features)
    if weight.shape[-1] != want:
        raise ValueError(f"{spec.format.name} rows of {spec.in_features} values take {want} bytes, "
                         f"the tensor has {weight.shape[-1]}")
    weight.quant = spec
    return weight


def quant_spec(weight: torch.Tensor) -> QuantSpec | None:
    """The `QuantSpec` of a quantized weight, None for a plain one."""
    return getattr(weight, "quant", None)


def quantized_available() -> bool:
    """Whether quantized weights can be multiplied here (the kernel built, an x86 CPU with AVX2)."""
    return linear_isa() != ISA_NONE


def qlinear(
    x: torch.Tensor,  # [..., K] bf16 or fp32
    weight: torch.Tensor,  # bf16 [N, K], or uint8 [N, row_bytes] with a QuantSpec
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # None: x.dtype; or torch.float32
    isa: int | None = None,  # None: linear_isa()
) -> torch.Tensor:  # [..., N]
    """`x @ dequant(weight).T + bias` on the compiled kernel, fp32 accumulation and one rounding
    (ggml formats: x quantized to 8-bit blocks first, see the module docstring).

    RuntimeError when the kernel is unavailable (see `quantized_available`)."""
    spec = quant_spec(weight)
    fmt, k = (spec.format, spec.in_features) if spec is not None else (FORMATS["bf16"], weight.shape[1])
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match a weight of {k} input features")
    level = linear_isa() if isa is None else isa
    if level == ISA_NONE:
        raise RuntimeError("the compiled CPU linear kernel is unavailable (disabled, not x86-64 "
                           "with AVX2, or the build failed)")
    out_fp32 = out_dtype == torch.float32 and x.dtype != torch.float32
    if spec is not None and spec.perm is not None:  # features in the rows' order
        x = x.index_select(-1, spec.perm)  # [..., K]
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    y = torch.ops.pagedserve_cpu.qlinear.default(x2, weight, fmt.code, k, bias, out_fp32, level,
                                                 gemm_rows(spec, x.dtype, level))
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


def qlinear_argmax(
    x: torch.Tensor,  # [M, K] bf16
    weight: torch.Tensor,  # uint8 [N, row_bytes] with a QuantSpec
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M] int64
    """`qlinear(x, weight, bias).argmax(dim=-1)`, bit for bit (the first maximum of the bf16 logits;
    a NaN counts as the maximum), without the [M, N] logits: the product runs in chunks of
    columns, each scanned while it is in cache (the greedy LM head).

    ValueError for an unquantized weight, a shape mismatch, or x not a bf16 matrix; RuntimeError
    when the kernel is unavailable."""
    spec = quant_spec(weight)
    if spec is None:
        raise ValueError("qlinear_argmax needs a quantized weight")
    if x.dim() != 2 or x.dtype is not torch.bfloat16 or x.shape[1] != spec.in_features:
        raise ValueError(f"x must be a bf16 [M, {spec.in_features}] matrix, got {x.dtype} "
                         f"{tuple(x.shape)}")
    level = linear_isa()
    if level == ISA_NONE:
        raise RuntimeError("the compiled CPU linear kernel is unavailable")
    if spec.perm is not None:  # features in the rows' order
        x = x.index_select(-1, spec.perm)  # [M, K]
    return torch.ops.pagedserve_cpu.qlinear_argmax.default(
        x.contiguous(), weight, spec.format.code, spec.in_features, bias, level,
        gemm_rows(spec, x.dtype, level))


def qembedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, any shape) of a quantized weight, dequantized: `[*ids.shape, K]` in the
    weight's `QuantSpec.dtype`."""
    spec = quant_spec(weight)
    if spec is None:
        raise ValueError("qembedding needs a quantized weight")
    level = linear_isa()
    if level == ISA_NONE:
        raise RuntimeError("the compiled CPU kernels are unavailable")
    flat = ids.reshape(-1).to(torch.long)
    y = torch.ops.pagedserve_cpu.qrows.default(weight, spec.format.code, spec.in_features, flat, level)
    if spec.perm is not None:  # back to the features' own order
        y = torch.empty_like(y).index_copy_(-1, spec.perm, y)
    return y.to(spec.dtype).reshape(*ids.shape, spec.in_features)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Weight-only INT8 with one scale per output row (absmax / 127, round to nearest): the
    uint8 `[N, 4 + K]` rows the kernel reads, marked with their `QuantSpec`."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization takes a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1) / 127.0  # [N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(wf / scale[:, None]), -127, 127).to(torch.int8)  # [N, K]
    out = torch.empty(n, 4 + k, dtype=torch.uint8)
    out[:, :4] = scale.contiguous().view(torch.uint8).view(n, 4)
    out[:, 4:] = q.view(torch.uint8)
    return set_quant(out, QuantSpec(FORMATS["int8"], k, dtype))
