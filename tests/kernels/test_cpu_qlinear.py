"""The format-generic CPU linear kernel (kernels/cpu_qlinear.py, csrc/qlinear.cpp): every weight
format against a dequantize-then-matmul reference of the same blocks (gguf's own dequantizer),
under every ISA level this machine has, and a row's result independent of its batch.

The ggml formats multiply 8-bit activations (csrc/qlinear_q8.h): they are checked against the
float64 product of the same quantized activations (tight), and against the unquantized product
within the bound that quantizing x to blocks of 32 allows (half a step per value)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_isa import ISA_ENV, ISA_LEVELS, isa_cap
from pagedserve.kernels.cpu_qlinear import (
    FORMATS,
    GEMM_ROWS,
    GEMM_ROWS_BY_FORMAT,
    QuantSpec,
    gemm_rows,
    qembedding,
    qlinear,
    quantize_int8,
    quantized_available,
    set_quant,
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from utils import K_QUANT_SCALES, ggml_block_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not quantized_available(), reason="compiled CPU kernels unavailable")

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
_K_SCALES = K_QUANT_SCALES


def _cpu_level() -> int:
    return int(torch.ops.pagedserve_cpu.cpu_isa()) if quantized_available() else 0


@pytest.fixture(params=list(ISA_LEVELS))
def isa(request, monkeypatch) -> int:
    """Each ISA level this machine has, set through $PAGEDSERVE_CPU_ISA."""
    level = ISA_LEVELS[request.param]
    if level > _cpu_level():
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv(ISA_ENV, request.param)
    assert cpu_gemm.linear_isa() == level
    return level


def ggml_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [n, row_bytes] blocks marked with their QuantSpec, float32 [n, k] reference values)."""
    qtype = GGML[fmt]
    raw = ggml_block_bytes(fmt, n, k, seed)
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    w = set_quant(torch.from_numpy(np.ascontiguousarray(raw)), QuantSpec(FORMATS[fmt], k))
    return w, ref


def weights(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt in GGML:
        return ggml_blocks(fmt, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * 0.05
    if fmt == "bf16":
        w = dense.to(torch.bfloat16)
        return w, w.float()
    w = quantize_int8(dense)
    return w, _int8_values(w)


def _int8_values(w: torch.Tensor) -> torch.Tensor:
    scale = w[:, :4].contiguous().view(torch.float32)  # [N, 1]
    return w[:, 4:].contiguous().view(torch.int8).float() * scale


FMTS = ["q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k", "int8", "bf16"]


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel quantizes it for the ggml formats (float64 values), and half a
    quantization step per value: blocks of 32, d = amax / 127, q = round-half-even(x * (127 / amax))
    in float32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # NOTE: `127.0 / amax` would be torch's reciprocal-then-multiply, not IEEE division
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    assert q.abs().max() <= 127
    d = (amax / 127.0).double()
    return (q.double() * d).reshape(m, k), (d / 2).expand(m, k // 32, 32).reshape(m, k)


def check_ggml_product(y: torch.Tensor, x: torch.Tensor, ref_w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y (fp32 out) against float64 references of the same blocks: the product of the quantized
    activations up to fp32 accumulation, and the exact product within the activations' rounding."""
    w64 = ref_w.double()
    b64 = torch.zeros(w64.shape[0], dtype=torch.float64) if bias is None else bias.double()
    xq, half_step = q8_activations(x)
    scale = xq.abs() @ w64.abs().T + b64.abs()  # what fp32 rounding of the sums is relative to
    err_q = (y.double() - (xq @ w64.T + b64)).abs()
    assert (err_q <= 1e-5 * scale + 1e-30).all(), float((err_q / scale).max())
    bound = half_step @ w64.abs().T  # |sum_k w (x - xq)| <= sum_k |w| step / 2
    err = (y.double() - (x.double() @ w64.T + b64)).abs()
    assert (err <= bound + 1e-5 * scale).all(), float((err - bound).max())


def invariant(w: torch.Tensor) -> torch.Tensor:
    """w marked batch-invariant: ggml formats on the 8-bit-activation kernel for every row count."""
    return set_quant(w, dataclasses.replace(w.quant, batch_invariant=True)) if w.dtype == torch.uint8 else w


@pytest.mark.parametrize("fmt", FMTS)
def test_product_matches_dequantize_then_matmul(fmt, isa):
    """The 8-bit-activation kernel (ggml formats, batch-invariant policy) and the bf16 / INT8
    weights' kernel at row counts 1 to 260."""
    n, k = 40, 512
    w, ref_w = weights(fmt, n, k)
    w = invariant(w)
    bias = torch.randn(n)
    for m in (1, 3, 17, 40, 260):  # the shape classes: 1, 2-8, 16-64, 256+
        x = torch.randn(m, k).to(torch.bfloat16)
        y = qlinear(x, w, bias, out_dtype=torch.float32)
        if fmt in GGML:
            check_ggml_product(y, x, ref_w, bias)
        else:
            ref = x.float() @ ref_w.T + bias
            # the bf16 levels round dequantized weights to bf16 (relative 2^-9 per weight)
            tol = 1e-2 if isa >= ISA_LEVELS["avx512bf16"] and fmt != "bf16" else 1e-4
            err = (y - ref).abs().max() / ref.abs().max()
            assert err < tol, (fmt, isa, m, float(err))
        yb = qlinear(x, w, bias)  # bf16 out: the fp32 result rounded once
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", list(GGML))
@pytest.mark.parametrize("n", [1, 7, 37])
def test_ggml_products_with_odd_row_counts_and_block_counts(fmt, n, isa):
    k = 3 * 256 if fmt in _K_SCALES else 5 * 32  # an odd number of blocks
    w, ref_w = weights(fmt, n, k, seed=n)
    for m in (1, 2, 6):
        x = torch.randn(m, k) * torch.logspace(-2, 1, k)  # blocks of very different scales
        check_ggml_product(qlinear(x, w), x, ref_w, None)


def test_ggml_blocks_with_extreme_values(isa):
    """Q8_0 weights of -128 and +127, and activations with a zero block and an outlier."""
    n, k = 5, 96
    raw = np.random.default_rng(4).integers(-128, 128, size=(n, k // 32, 32)).astype(np.int8)
    raw[:, :, :8] = -128
    raw[:, :, 8:16] = 127
    blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.full((n, k // 32), 0.01, np.float16)[..., None].view(np.uint8)
    blocks[..., 2:] = raw.view(np.uint8)
    blocks = blocks.reshape(n, -1)
    w = set_quant(torch.from_numpy(blocks), QuantSpec(FORMATS["q8_0"], k))
    ref_w = torch.from_numpy(dequantize(blocks, T.Q8_0).astype(np.float32))
    x = torch.randn(3, k)
    x[0, :32] = 0.0
    x[1, 40] = 1e4
    x[2] = -x[2].abs()  # all negative: every block's amax is -x
    check_ggml_product(qlinear(x, w), x, ref_w, None)
    xb = x.to(torch.bfloat16)  # the blocked GEMM (forced from row 1): 8-bit on AVX512-BF16
    check_gemm_product(_op(xb, w, isa, 1), xb, ref_w, None, "q8_0", isa)


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k", "q4_k", "int8"])
def test_float32_activations(fmt, isa):
    n, k = 24, 256
    w, ref_w = weights(fmt, n, k, seed=1)
    x = torch.randn(4, k)
    if fmt in GGML:  # bf16 x of 4 rows stays on the 8-bit kernel at every level (below its GEMM)
        assert all(not 0 < gemm_rows(w.quant, torch.bfloat16, level) <= 4 for level in ISA_LEVELS.values())
    y = qlinear(x, w)
    assert y.dtype == torch.float32
    if fmt in GGML:
        check_ggml_product(y, x, ref_w, None)
        # bf16 and fp32 activations of the same values give the same bits
        xb = x.to(torch.bfloat16)
        assert torch.equal(qlinear(xb, w, out_dtype=torch.float32), qlinear(xb.float(), w))
    else:
        torch.testing.assert_close(y, x @ ref_w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt, isa):
    """Under the batch-invariant policy (ggml formats: `QuantSpec.batch_invariant`; bf16 and INT8
    weights always) a row's bits do not depend on the batch."""
    n, k = 57, 256
    w = invariant(weights(fmt, n, k, seed=2)[0])
    x = torch.randn(64, k).to(torch.bfloat16)
    full = qlinear(x, w, out_dtype=torch.float32)
    for rows in ([0], [5], [63], [3, 4], [10, 11, 12, 13, 14], list(range(17, 50))):
        part = qlinear(x[rows].contiguous(), w, out_dtype=torch.float32)
        assert torch.equal(part, full[rows]), (fmt, rows)


def test_bf16_weights_with_any_k_and_batch_invariance(isa):
    w = torch.randn(37, 200).to(torch.bfloat16)
    x = torch.randn(9, 200).to(torch.bfloat16)
    full = cpu_gemm.bf16_linear(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(full, x.float() @ w.float().T, rtol=1e-4, atol=1e-4)
    for i in range(9):
        assert torch.equal(cpu_gemm.bf16_linear(x[i:i + 1], w, out_dtype=torch.float32)[0], full[i])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_0", "q4_k", "q6_k", "int8"])
def test_embedding_rows_are_the_dequantized_rows(fmt, isa):
    w, ref_w = weights(fmt, 30, 256, seed=3)
    ids = torch.tensor([[0, 29], [7, 7]])
    rows = qembedding(ids, set_quant(w, QuantSpec(w.quant.format, 256, torch.float32)))
    assert rows.shape == (2, 2, 256) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, ref_w[ids], rtol=1e-6, atol=1e-7)


def test_int8_quantization_error_is_within_half_a_step_per_row():
    w = torch.randn(16, 96) * torch.logspace(-3, 1, 16)[:, None]
    w[3] = 0.0  # an all-zero row keeps a usable scale
    q = quantize_int8(w)
    assert q.dtype == torch.uint8 and q.shape == (16, 100)
    values = _int8_values(q)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((values - w).abs() <= step / 2 + 1e-12).all()
    assert torch.equal(values[3], torch.zeros(96))


def test_wrong_weight_bytes_and_unknown_isa_are_value_errors(monkeypatch):
    with pytest.raises(ValueError, match="take 544 bytes"):
        set_quant(torch.zeros(2, 500, dtype=torch.uint8), QuantSpec(FORMATS["q8_0"], 512))
    with pytest.raises(ValueError, match="multiple of 256"):
        FORMATS["q4_k"].row_bytes(640)
    monkeypatch.setenv(ISA_ENV, "sse2")
    with pytest.raises(ValueError, match=ISA_ENV):
        isa_cap()


def test_capping_at_avx2_keeps_the_decode_kernels_and_turns_off_the_avx512_sampling(monkeypatch):
    if _cpu_level() < ISA_LEVELS["avx512"]:
        pytest.skip("this CPU lacks AVX-512")
    assert cpu_gemm.kernel_available() and cpu_gemm.sampling_kernel_available()
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert cpu_gemm.linear_isa() == ISA_LEVELS["avx2"]
    assert cpu_gemm.kernel_available() and not cpu_gemm.sampling_kernel_available()


def _op(x: torch.Tensor, w: torch.Tensor, isa: int, rows: int, bias: torch.Tensor | None = None,
        fp32: bool = True) -> torch.Tensor:
    """The kernel with an explicit `gemm_rows` (fp32 out unless `fp32=False`)."""
    spec = w.quant
    return torch.ops.pagedserve_cpu.qlinear.default(x, w, spec.format.code, spec.in_features, bias,
                                                    fp32, isa, rows)


def _bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


# The ggml formats whose GEMM is an 8-bit one: every ggml format on AVX2 (csrc/qlinear_q8_gemm.h),
# the table's VNNI rows at the AVX512-BF16 level (csrc/qlinear_vnni.h): x quantized as the
# small-batch kernel quantizes it, exact integer block sums.
VNNI_FMTS = tuple(name for name, f in FORMATS.items() if f.gemm == "VNNI")


def _int8_gemm(fmt: str, isa: int) -> bool:
    if isa == ISA_LEVELS["avx2"]:
        return fmt in GGML or fmt in ("q4_z", "q8_f")
    return fmt in VNNI_FMTS and isa == ISA_LEVELS["avx512bf16"]


def check_gemm_product(y, x, ref_w, bias, fmt, isa) -> None:
    """The blocked GEMM's y (fp32 out) against float64 references: the product of the 8-bit
    activations for the 8-bit GEMM; else the weights dequantized exactly, to bf16 on the bf16
    levels (fp32 below), times x, up to fp32 accumulation."""
    if _int8_gemm(fmt, isa):
        return check_ggml_product(y, x, ref_w, bias)
    b64 = torch.zeros(ref_w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    wq = _bf16_round(ref_w) if isa >= ISA_LEVELS["avx512bf16"] else ref_w
    want = x.double() @ wq.double().T + b64
    scale = x.double().abs() @ wq.double().abs().T + b64.abs()
    assert ((y.double() - want).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("fmt", list(GGML))
@pytest.mark.parametrize("m", [1, 5, 16, 64, 260])  # the shape classes: 1, 2-8, 16-64, 256+
def test_blocked_gemm_matches_dequantize_then_matmul(fmt, m, isa):
    """The blocked GEMM over ggml blocks (forced from row 1): the weights dequantized exactly, to
    bf16 on the bf16 levels (fp32 below), then an fp32-accumulated product; or, for the 8-bit
    GEMM, the 8-bit activations' product."""
    n, k = 45, 512
    w, ref_w = ggml_blocks(fmt, n, k, seed=3)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = _op(x, w, isa, 1)
    check_gemm_product(y, x, ref_w, None, fmt, isa)
    bias = torch.randn(n)
    yb = _op(x, w, isa, 1, bias)
    assert torch.equal(yb, y + bias)  # the bias added once, after the sum
    y16 = _op(x, w, isa, 1, bias, fp32=False)  # bf16 out: the fp32 result rounded once
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, yb.to(torch.bfloat16))


@pytest.mark.parametrize("m", [3, 16, 40, 300])  # small-batch kernel, GEMM, GEMM over many row groups
def test_activation_quantization_rounds_half_to_even_exactly_in_every_kernel(m, isa):
    """x whose blocks each hold +-127 (so d = 1 and q = round(x)) with many halves, times Q8_0
    weights of scale 1: every product and sum is an integer below 2^24, so each kernel's fp32
    result must be the exact integer whatever its order. A quantization that rounds a tie the
    other way, or loses a value in its packing, moves a result by at least 1 (csrc's
    vnni_quantize_row repeats quantize_row's steps on 16 lanes: this pins them together)."""
    n, k = 70, 256
    rng = np.random.default_rng(21)
    halves = rng.integers(-200, 200, size=(m, k)) / 2.0  # -100.0 .. 99.5: ties at every .5
    halves[:, ::32] = np.where(rng.random((m, k // 32)) < 0.5, 127.0, -127.0)  # amax = 127
    x = torch.from_numpy(halves).float().to(torch.bfloat16)
    assert torch.equal(x.double(), torch.from_numpy(halves))  # representable in bf16
    qw = rng.integers(-127, 128, size=(n, k // 32, 32), dtype=np.int8)
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[..., :2] = np.ones((n, k // 32, 1), dtype=np.float16).view(np.uint8)
    raw[..., 2:] = qw.view(np.uint8)
    w = set_quant(torch.from_numpy(raw.reshape(n, -1)), QuantSpec(FORMATS["q8_0"], k))
    w64 = torch.from_numpy(qw.reshape(n, k)).double()
    want = torch.round(x.double()) @ w64.T  # half to even
    assert not torch.equal(want, x.double() @ w64.T)
    assert torch.equal(_op(x, w, isa, 0).double(), want)  # the small-batch kernel at every M
    # the GEMM from row 1 on: 8-bit x where it is an 8-bit GEMM (AVX512F's multiplies x as it is)
    assert torch.equal(_op(x, w, isa, 1).double(), want if _int8_gemm("q8_0", isa) else x.double() @ w64.T)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q6_k"])
def test_blocked_gemm_over_many_column_groups_and_long_rows(fmt, isa):
    """Columns in several groups of blocks and output stages (N = 300: a partial last block), rows
    of 2048 values (4 KiB of bf16: the padded buffer stride), rows of x in several slabs."""
    n, k, m = 300, 2048, 150
    w, ref_w = ggml_blocks(fmt, n, k, seed=9)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n)
    y = _op(x, w, isa, 1, bias)
    check_gemm_product(y, x, ref_w, bias, fmt, isa)


@pytest.mark.parametrize("fmt", ["q5_0", "q8_0", "q4_k", "q4_1"])
def test_a_rows_gemm_result_does_not_depend_on_its_batch(fmt, isa):
    """Among batches that take the blocked GEMM, a row's result is the same bits whatever the
    batch around it and wherever the row sits in it."""
    n, k = 70, 512
    w, _ = ggml_blocks(fmt, n, k, seed=10)
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(100, k, generator=g).to(torch.bfloat16)
    alone = _op(rows[:16], w, isa, 1)
    mixed = _op(torch.cat([rows[40:73], rows[:16], rows[80:100]]), w, isa, 1)
    assert torch.equal(mixed[33:49], alone)


@pytest.mark.parametrize("fmt", ["q5_0", "q4_k", "bf16"])
def test_a_prompt_sized_gemm_has_the_bits_of_its_rows_in_a_small_batch(fmt, isa):
    """A prompt-sized product (256+ rows: bigger column chunks per thread, and on AMX up to 8
    blocks of 16 weight rows dequantized per pass over x) gives each row the bits it gets in a
    small GEMM batch, over many chunks and a partial last block; and matches the reference."""
    n, k, m = 1000, 768, 300
    if fmt == "bf16":
        ref_w = torch.randn(n, k).to(torch.bfloat16)
        w = ref_w
    else:
        w, ref_w = ggml_blocks(fmt, n, k, seed=12)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    if fmt == "bf16":
        op = torch.ops.pagedserve_cpu.qlinear.default
        run = lambda xs: op(xs, w, 0, k, None, True, isa, 1)  # noqa: E731
    else:
        run = lambda xs: _op(xs, w, isa, 1)  # noqa: E731
    big = run(x)
    assert torch.equal(big[100:120], run(x[100:120]))
    assert torch.equal(big[-16:], run(x[-16:]))
    if fmt != "bf16":
        check_gemm_product(big, x, ref_w, None, fmt, isa)


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_a_gemm_over_rows_of_4096_values_into_a_staged_output_keeps_every_column(fmt, isa):
    """K = 4096 (a 7B/8B model's hidden size, Qwen3-MoE's attention output): on AMX the GEMM then
    dequantizes 7 blocks of 16 weight rows per pass (112 columns), which the 128-column output
    stage must take whole; N = 2048 fp32 outputs (8 KiB rows of y: staged, not written in place),
    one thread (chunks of 256 columns: a second group crosses the stage's end).
    NOTE: a group that ran past the stage wrote beyond its buffer (heap corruption, wrong
    columns) before the stage was flushed by the group's end."""
    n, k, m = 2048, 4096, 24
    w, ref_w = ggml_blocks(fmt, n, k, seed=14)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = _op(x, w, isa, 1)
        rows = _op(x[8:24], w, isa, 1)
    finally:
        torch.set_num_threads(threads)
    check_gemm_product(y, x, ref_w, None, fmt, isa)
    assert torch.equal(y[8:24], rows)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_k", "q6_k"])
def test_the_kernel_is_chosen_by_row_count(fmt, isa):
    """Below `gemm_rows(...)` rows a bf16 product over ggml blocks is the 8-bit-activation kernel's,
    from there on the blocked GEMM's, bit for bit; float32 x and batch-invariant weights always
    take the 8-bit-activation kernel."""
    n, k = 40, 256
    w, _ = ggml_blocks(fmt, n, k, seed=4)
    threshold = gemm_rows(w.quant, torch.bfloat16, isa)
    assert threshold == GEMM_ROWS_BY_FORMAT.get(isa, {}).get(fmt, GEMM_ROWS.get(isa, 0))
    assert gemm_rows(w.quant, torch.float32, isa) == 0
    assert gemm_rows(dataclasses.replace(w.quant, batch_invariant=True), torch.bfloat16, isa) == 0
    for m in sorted({1, 2, max(1, threshold - 1), threshold, threshold + 7, 64} - {0}):
        x = torch.randn(m, k).to(torch.bfloat16)
        y = qlinear(x, w, out_dtype=torch.float32)
        kernel = 1 if threshold and m >= threshold else 0
        assert torch.equal(y, _op(x, w, isa, kernel)), (m, threshold)
        if kernel:  # the two kernels round differently: the choice is visible
            assert not torch.equal(y, _op(x, w, isa, 0))


@pytest.mark.parametrize("m", [1, 5, 7, 10, 16, 64])
def test_fused_products_equal_the_products_one_by_one(m, isa):
    """qlinear_fused (q / k / v, gate / up of the fused decoder layer: one parallel region, x
    quantized once per format offset) gives each weight's qlinear result bit for bit, for mixed
    formats, both kernels (each weight's own row threshold: at some M one weight runs the GEMM
    and another the small-batch kernel) and with biases."""
    k = 512
    ws = [ggml_blocks("q5_0", 48, k, seed=5)[0], ggml_blocks("q8_0", 16, k, seed=6)[0],
          ggml_blocks("q4_k", 40, k, seed=7)[0], weights("bf16", 24, k, seed=8)[0]]
    biases = [torch.randn(48), None, torch.randn(40), None]
    x = torch.randn(m, k).to(torch.bfloat16)
    rows = [gemm_rows(getattr(w, "quant", None), torch.bfloat16, isa) for w in ws]
    fmts = [w.quant.format.code if w.dtype == torch.uint8 else 0 for w in ws]
    fused = torch.ops.pagedserve_cpu.qlinear_fused.default(x, ws, fmts, k, biases, isa, rows)
    for w, b, y in zip(ws, biases, fused):
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, qlinear(x, w, b)), (m, w.dtype)


@pytest.mark.parametrize("m", [1, 5, 16, 70])
@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_k", "q6_k"])
def test_fused_argmax_is_the_argmax_of_the_product(fmt, m, isa):
    """qlinear_argmax (the greedy LM head: the product scanned chunk by chunk, no logits in
    memory) returns the argmax of qlinear's bf16 logits for every kernel: columns over several
    chunks with a partial last one, ties won by the first column, a NaN in x (NaN logits where the
    kernel propagates it, whatever the 8-bit quantization makes of it elsewhere: the same either
    way)."""
    from pagedserve.kernels.cpu_qlinear import qlinear_argmax

    n, k = 2500, 256
    w, _ = ggml_blocks(fmt, n, k, seed=12)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    if m > 2:
        x[2, 3] = float("nan")
    best = int(qlinear(x, w)[0].argmax())
    copies = [(best + 1) % n, (best + 1300) % n]  # the same row: a tie within a chunk and across
    raw = w.clone()
    raw[copies] = raw[best].clone()
    w = set_quant(raw, w.quant)
    logits = qlinear(x, w)
    got = qlinear_argmax(x, w)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert int(got[0]) == min(best, *copies)


@pytest.mark.parametrize("fmt", list(GGML))
def test_ggml_blocks_times_x_as_it_is_without_int8_activations(fmt, isa):
    """`QuantSpec.int8_activations=False` (EngineArgs.gguf_activations="dtype"): no 8-bit x at
    any row count -- the blocks dequantized (to bf16 on the bf16 levels, fp32 below) times x, up
    to fp32 accumulation, one kernel for every row count (a row's bits do not depend on its
    batch), float32 x too."""
    n, k = 37, 512
    w, ref_w = ggml_blocks(fmt, n, k, seed=13)
    w = set_quant(w, dataclasses.replace(w.quant, int8_activations=False))
    assert gemm_rows(w.quant, torch.bfloat16, isa) == gemm_rows(w.quant, torch.float32, isa) == -1
    x = torch.randn(20, k).to(torch.bfloat16)
    y = qlinear(x, w, out_dtype=torch.float32)
    wq = _bf16_round(ref_w) if isa >= ISA_LEVELS["avx512bf16"] else ref_w
    want, scale = x.double() @ wq.double().T, x.double().abs() @ wq.double().abs().T
    assert ((y.double() - want).abs() <= 1e-5 * scale + 1e-30).all(), (fmt, isa)
    for rows in ([3], [0, 1, 2], list(range(5, 17))):
        assert torch.equal(qlinear(x[rows].contiguous(), w, out_dtype=torch.float32), y[rows])
    xf = torch.randn(3, k)
    want = xf.double() @ ref_w.double().T
    scale = xf.double().abs() @ ref_w.double().abs().T
    assert ((qlinear(xf, w).double() - want).abs() <= 1e-5 * scale + 1e-30).all()


# The HF checkpoints' formats (layers.hf_quant): Q4_Z (4-bit codes less a zero point of 0..16, as
# GPTQ v1's asymmetric zeros read), Q8_F (int8 with an fp32 scale) on the 8-bit kernels.
HF_DOT8 = ("q4_z", "q8_f")


def hf_rows(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of `fmt` marked with their QuantSpec, float32 [n, k] values d * (q - z) / d * q)."""
    from pagedserve.layers.hf_quant import q4z_rows, q8f_rows

    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).to(torch.float16).float()  # [n, B]
    if fmt == "q4_z":
        q = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
        z = torch.randint(0, 17, (n, k // 32), generator=gen).to(torch.uint8)
        z[:, 0] = 16
        raw, values = q4z_rows(q, z, d), q.float().view(n, -1, 32) - z.float().unsqueeze(-1)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
        q[:, :8] = -128
        raw, values = q8f_rows(q, d), q.float().view(n, -1, 32)
    ref = (values * d.unsqueeze(-1)).reshape(n, k)
    return set_quant(raw, QuantSpec(FORMATS[fmt], k)), ref


@pytest.mark.parametrize("fmt", HF_DOT8)
def test_hf_formats_on_the_8bit_kernel_the_gemm_and_embedding_rows(fmt, isa):
    n, k = 37, 160  # an odd number of blocks
    w, ref_w = hf_rows(fmt, n, k)
    bias = torch.randn(n)
    for m in (1, 6):  # fp32 x: the 8-bit kernel
        x = torch.randn(m, k) * torch.logspace(-2, 1, k)
        check_ggml_product(qlinear(x, w, bias), x, ref_w, bias)
    xb = torch.randn(20, k).to(torch.bfloat16)  # the blocked GEMM, forced from row 1
    check_gemm_product(_op(xb, w, isa, 1), xb, ref_w, None, fmt, isa)
    ids = torch.tensor([[0, 36], [5, 5]])
    rows = qembedding(ids, set_quant(w, QuantSpec(w.quant.format, k, torch.float32)))
    assert torch.equal(rows, ref_w[ids])


def test_permuted_features_gather_x_first(isa):
    """QuantSpec.perm (GPTQ act-order rows): the product is that of x's features in the rows'
    order, the embedding rows come back in the features' own order."""
    w, ref_w = hf_rows("q4_z", 16, 64, seed=5)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    wp = set_quant(w.clone(), dataclasses.replace(w.quant, perm=perm))
    x = torch.randn(3, 64)
    assert torch.equal(qlinear(x, wp), qlinear(x[:, perm].contiguous(), w))
    rows = qembedding(torch.tensor([2]), set_quant(wp, dataclasses.replace(wp.quant, dtype=torch.float32)))
    assert torch.equal(rows[0, perm], ref_w[2])


def test_f8_e4m3_rows_dense_product_and_embedding_rows(isa):
    """F8_E4M3 (FP8 checkpoints' block-scaled weights): every E4M3 byte (subnormals, +-448, the
    zeros; no NaN) decoded exactly, times its block's scale; the product multiplies x as it is
    (a DENSE row: dequantized weights, rounded to bf16 on the bf16 levels)."""
    from pagedserve.layers.hf_quant import f8_rows

    n, k = 24, 256
    codes = torch.arange(256, dtype=torch.int64).reshape(1, 256).repeat(n, 1)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # NaN -> 1.0
    codes = codes[:, torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    w8 = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    d = (torch.rand(n, k // 32, generator=torch.Generator().manual_seed(1)) + 0.5) * 1e-3
    w = set_quant(f8_rows(w8, d), QuantSpec(FORMATS["f8_e4m3"], k))
    ref_w = (w8.float().view(n, -1, 32) * d.unsqueeze(-1)).reshape(n, k)
    rows = qembedding(torch.tensor([[3, 0]]), set_quant(w, QuantSpec(w.quant.format, k, torch.float32)))
    assert torch.equal(rows[0], ref_w[[3, 0]])
    for m in (1, 9):
        x = torch.randn(m, k)
        torch.testing.assert_close(qlinear(x, w), x @ ref_w.T, rtol=1e-4, atol=1e-5)
        xb = x.to(torch.bfloat16)
        wq = _bf16_round(ref_w) if isa >= ISA_LEVELS["avx512bf16"] else ref_w
        torch.testing.assert_close(qlinear(xb, w, out_dtype=torch.float32), xb.float() @ wq.T,
                                   rtol=1e-4, atol=1e-5)
