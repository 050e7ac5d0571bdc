"""The small-batch 8-bit kernel on AVX512-VNNI (csrc/qlinear_q8_vnni.h) against its AVX2 body
(csrc/qlinear_q8.h): bit for bit, for every DOT8 format, row count, odd block count, bias and
output dtype. The AVX2 body itself is checked against float64 references in test_cpu_qlinear.py;
this equality is what keeps the ISA levels agreeing and batch invariance across them."""

from __future__ import annotations

import pytest
import torch
from test_cpu_mxfp4 import mxfp4_blocks
from test_cpu_qlinear import GGML, _op, ggml_blocks, hf_rows

from pagedserve.kernels.cpu_isa import ISA_LEVELS
from pagedserve.kernels.cpu_qlinear import quantized_available

pytestmark = pytest.mark.skipif(
    not quantized_available() or int(torch.ops.pagedserve_cpu.cpu_isa()) < ISA_LEVELS["avx512bf16"],
    reason="needs the compiled kernels on an AVX512-BF16 (+ VNNI) CPU")

AVX2, VNNI = ISA_LEVELS["avx2"], ISA_LEVELS["avx512bf16"]


def _weights(fmt: str, n: int, k: int):
    if fmt in GGML:
        return ggml_blocks(fmt, n, k, seed=3)[0]
    if fmt == "mxfp4":
        return mxfp4_blocks(n, k, seed=3)[0]
    return hf_rows(fmt, n, k, seed=3)[0]


@pytest.mark.parametrize("fmt", [*GGML, "mxfp4", "q4_z", "q8_f"])
def test_vnni_small_batch_kernel_equals_the_avx2_body_bit_for_bit(fmt):
    # K-quants: 2 super-blocks; the 32-value formats: 7 blocks (an odd count: the last one alone)
    k = 512 if fmt in ("q4_k", "q5_k", "q6_k") else 224
    n = 37  # tiles of 4 columns, then single columns
    w = _weights(fmt, n, k)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 6, 9):
        x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
        for b, fp32 in ((None, True), (bias, False)):
            want = _op(x, w, AVX2, 0, b, fp32)  # gemm_rows 0: the 8-bit kernel at every row count
            got = _op(x, w, VNNI, 0, b, fp32)
            assert torch.equal(got.view(torch.int16) if not fp32 else got.view(torch.int32),
                               want.view(torch.int16) if not fp32 else want.view(torch.int32)), (fmt, m)
