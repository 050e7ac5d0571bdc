"""MXFP4 weights (gpt-oss's experts; csrc/qlinear_mxfp4.h) on the 8-bit-activation kernel:
against gguf's own dequantizer of the same blocks (the float64 product of the kernel's quantized
activations, tight; the unquantized product within half an activation step), at every ISA
level, any row count (no blocked GEMM takes the format: a row's bits never depend on its batch),
and the row dequantizer (qrows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_qlinear import check_ggml_product, isa  # noqa: F401  (isa: the ISA fixture)

from pagedserve.kernels.cpu_qlinear import FORMATS, QuantSpec, gemm_rows, qembedding, qlinear, set_quant

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


def mxfp4_blocks(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [n, k / 32 * 17] MXFP4 rows with their QuantSpec, float32 [n, k] values): gguf's
    quantizer over weights of very different block scales (so the E8M0 exponents vary), the
    extreme codes included."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, k)).astype(np.float32) * np.logspace(-3, 1, k, dtype=np.float32)
    raw = quantize(dense, T.MXFP4)
    raw[0, 1:17] = 0x7F  # +6 and -0 codes
    raw[-1, 1:17] = 0xF7  # +6 and -6
    raw[-1, 0] = 1  # a subnormal scale
    ref = torch.from_numpy(dequantize(raw, T.MXFP4).astype(np.float32))
    return set_quant(torch.from_numpy(np.ascontiguousarray(raw)), QuantSpec(FORMATS["mxfp4"], k)), ref


def test_mxfp4_products_at_every_row_count(isa):
    n, k = 37, 5 * 32
    w, ref_w = mxfp4_blocks(n, k)
    bias = torch.randn(n)
    assert gemm_rows(w.quant, torch.bfloat16, isa) == 0  # the 8-bit kernel at every row count
    for m in (1, 3, 17, 70):
        x = torch.randn(m, k) * torch.logspace(-2, 1, k)
        check_ggml_product(qlinear(x, w, bias), x, ref_w, bias)  # float32 x
        xb = x.to(torch.bfloat16)
        y = qlinear(xb, w, bias, out_dtype=torch.float32)
        check_ggml_product(y, xb, ref_w, bias)
        assert torch.equal(qlinear(xb, w, bias), y.to(torch.bfloat16))
        # a row's bits do not depend on its batch
        assert torch.equal(qlinear(xb[m // 2 : m // 2 + 1], w, bias, out_dtype=torch.float32), y[m // 2 : m // 2 + 1])


def test_mxfp4_rows_are_the_dequantized_rows(isa):
    w, ref_w = mxfp4_blocks(9, 64, seed=1)
    ids = torch.tensor([3, 0, 8, 3])
    w.quant = QuantSpec(FORMATS["mxfp4"], 64, torch.float32)
    assert torch.equal(qembedding(ids, w), ref_w[ids])
