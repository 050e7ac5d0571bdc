"""The format-generic CPU linear kernel (kernels/cpu_qlinear.py, csrc/qlinear.cpp): every weight
format against a dequantize-then-matmul reference of the same blocks (gguf's own dequantizer),
under every ISA level this machine has, and a row's result independent of its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_isa import ISA_ENV, ISA_LEVELS, isa_cap
from pagedserve.kernels.cpu_qlinear import (
    FORMATS,
    QuantSpec,
    qembedding,
    qlinear,
    quantize_int8,
    quantized_available,
    set_quant,
)

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(not quantized_available(), reason="compiled CPU kernels unavailable")

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q5_0": T.Q5_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
# byte offsets of the fp16 scales inside a K-quant block (d, and dmin where there is one)
_K_SCALES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


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
    rng = np.random.default_rng(seed)
    qtype = GGML[fmt]
    if fmt in _K_SCALES:  # gguf cannot quantize K-quants: random blocks with small scales are valid
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // 256, block_bytes), dtype=np.uint8)
        for off in _K_SCALES[fmt]:
            scales = (rng.random((n, k // 256)) * 0.004 + 0.001).astype(np.float16)
            raw[..., off:off + 2] = scales.view(np.uint8).reshape(n, k // 256, 2)
        raw = raw.reshape(n, -1)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
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


FMTS = ["q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k", "int8", "bf16"]


@pytest.mark.parametrize("fmt", FMTS)
def test_product_matches_dequantize_then_matmul(fmt, isa):
    n, k = 40, 512
    w, ref_w = weights(fmt, n, k)
    bias = torch.randn(n)
    for m in (1, 3, 17, 40):
        x = torch.randn(m, k).to(torch.bfloat16)
        y = qlinear(x, w, bias, out_dtype=torch.float32)
        ref = x.float() @ ref_w.T + bias
        # the bf16 levels round dequantized weights to bf16 (relative 2^-9 per weight)
        tol = 1e-2 if isa >= ISA_LEVELS["avx512bf16"] and fmt != "bf16" else 1e-4
        err = (y - ref).abs().max() / ref.abs().max()
        assert err < tol, (fmt, isa, m, float(err))
        yb = qlinear(x, w, bias)  # bf16 out: the fp32 result rounded once
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k", "int8"])
def test_float32_activations_match_the_reference_closely(fmt, isa):
    n, k = 24, 256
    w, ref_w = weights(fmt, n, k, seed=1)
    x = torch.randn(5, k)
    y = qlinear(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ ref_w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt, isa):
    n, k = 56, 256
    w, _ = weights(fmt, n, k, seed=2)
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


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_k", "q6_k", "int8"])
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


def test_capping_below_avx512bf16_turns_off_the_avx512bf16_kernels(monkeypatch):
    if _cpu_level() < ISA_LEVELS["avx512bf16"]:
        pytest.skip("this CPU lacks AVX512-BF16")
    assert cpu_gemm.kernel_available()
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert not cpu_gemm.kernel_available() and cpu_gemm.linear_isa() == ISA_LEVELS["avx2"]
