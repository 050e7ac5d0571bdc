"""Greedy tokens without fp32 logits (kernels.cpu_argmax): the bf16 argmax scan against
torch.argmax of the fp32 logits, ties across pieces, NaN and infinities included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.kernels import cpu_argmax, cpu_gemm
from pagedserve.kernels.cpu_gemm import bf16_linear
from pagedserve.kernels.extension import kernels_disabled


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 32])
@pytest.mark.parametrize("n", [37, 50257, 65536])
def test_argmax_bf16_equals_the_argmax_of_the_fp32_logits(kernel, m, n):
    torch.manual_seed(m * n)
    logits = bf16_linear(torch.randn(m, 64).bfloat16(), torch.randn(n, 64).bfloat16())
    got = cpu_argmax.argmax_bf16(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("m", [1, 3, 16])
def test_argmax_bf16_takes_the_first_of_equal_maxima_across_pieces(kernel, m):
    # Identical rows of W give identical logits; they sit in different pieces of the parallel
    # scan (32K columns each), which finish in any order.
    torch.manual_seed(0)
    n = 70000
    x = torch.randn(m, 64).bfloat16()
    w = (torch.randn(n, 64) * 0.01).bfloat16()
    top = x[0].float().sign().bfloat16()  # a large logit for row 0
    for j in (60000, 4100, 100, 33333):
        w[j] = top
    logits = bf16_linear(x, w)
    got = cpu_argmax.argmax_bf16(logits)
    assert torch.equal(got, logits.float().argmax(dim=-1)) and int(got[0]) == 100


def test_argmax_bf16_counts_nan_as_the_maximum_and_takes_the_first(kernel):
    torch.manual_seed(1)
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(40000, 64).bfloat16()
    w[35000, 3] = float("nan")  # NaN logits in every row at 35000 and 9000
    w[9000, 7] = float("nan")
    w[200] = x[0]  # the largest number for row 0, before the NaNs
    logits = bf16_linear(x, w)
    got = cpu_argmax.argmax_bf16(logits)
    assert torch.equal(got, logits.float().argmax(dim=-1)) and got.tolist() == [9000] * 4


def test_argmax_bf16_declines_what_the_kernel_does_not_take(kernel):
    x = torch.randn(2, 64)
    assert cpu_argmax.argmax_bf16(x) is None  # float32
    assert cpu_argmax.argmax_bf16(x.bfloat16()[:, :0]) is None  # empty vocabulary
    assert cpu_argmax.argmax_bf16(x.bfloat16()[0]) is None  # not a matrix
    with torch.enable_grad():
        assert cpu_argmax.argmax_bf16(x.bfloat16().requires_grad_()) is None


_SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from(_SPECIAL), min_size=1, max_size=70),
                     min_size=1, max_size=5),
       width=st.sampled_from([1, 17, 40000]))
def test_argmax_bf16_equals_torch_argmax_with_ties_infinities_and_nan(rows, width):
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here")
    # Each row: its listed values spread over `width`-long stretches (ties far apart), -inf between.
    n = max(len(r) for r in rows) * width
    x = torch.full((len(rows), n), float("-inf"))
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            x[i, j * width] = v
    x = x.bfloat16()
    assert torch.equal(cpu_argmax.argmax_bf16(x), x.float().argmax(dim=-1))


def test_argmax_bf16_of_rows_all_minus_infinity_is_zero(kernel):
    x = torch.full((3, 70000), float("-inf"), dtype=torch.bfloat16)
    assert cpu_argmax.argmax_bf16(x).tolist() == [0, 0, 0]
