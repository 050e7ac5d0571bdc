"""The prompt-chunk attention kernel (csrc/prefill_attention.cpp) against exact attention."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_attention import prefill_attention
from pagedserve.kernels.cpu_gemm import kernel_available, linear_isa
from pagedserve.kernels.cpu_isa import ISA_LEVELS

pytestmark = pytest.mark.skipif(not kernel_available() or linear_isa() < ISA_LEVELS["avx2"],
                                reason="needs the CPU kernels on an AVX2 CPU")


@pytest.fixture(params=["avx2", "avx512bf16", "amx"])
def isa(request, monkeypatch):
    """Each build of the kernel: AVX2 (fp32 widening), AVX512-BF16 and AMX tiles
    (PAGEDSERVE_CPU_ISA caps the level the wrapper asks for)."""
    if linear_isa() < ISA_LEVELS[request.param]:
        pytest.skip(f"the CPU has no {request.param}")
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", request.param)
    return request.param


def _reference(q, k, v, scale, window):
    """Exact (float64) causal attention of the chunk q (the context's last n positions) and the
    weights (for the error bound)."""
    n, hq, d = q.shape
    ctx, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, dim=1)  # [ctx, Hq, D]
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("nhd,chd->hnc", q.double(), kk) * scale  # [Hq, n, ctx]
    qp = torch.arange(ctx - n, ctx).unsqueeze(1)
    kp = torch.arange(ctx).unsqueeze(0)
    mask = kp <= qp
    if window:
        mask &= qp - kp < window
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hnc,chd->nhd", p, vv), torch.einsum("hnc,chd->nhd", p, vv.abs())


@pytest.mark.parametrize("n,ctx,hq,hkv,d,window", [
    (1, 1, 1, 1, 32, 0), (7, 7, 2, 1, 32, 0), (16, 16, 4, 1, 64, 0), (37, 37, 4, 2, 96, 0),
    (160, 160, 4, 1, 256, 0), (33, 100, 4, 1, 64, 0), (5, 64, 2, 2, 32, 0),
    (70, 70, 4, 1, 64, 8), (40, 101, 2, 1, 32, 17), (200, 200, 4, 1, 256, 512),
    (3, 50, 8, 2, 128, 4), (45, 80, 6, 2, 64, 0), (30, 70, 5, 1, 64, 20),
    (20, 45, 16, 1, 576, 0),  # MLA (DeepSeek V2): one latent "head" of 512 + 64
    # contexts past 640 keys: the weighted sum of values in chunks of keys, partial sums kept
    (40, 1500, 4, 1, 256, 0), (33, 900, 2, 2, 64, 700),
])
def test_prefill_attention_matches_exact_attention(n, ctx, hq, hkv, d, window, isa):
    """Causal by position (the chunk is the context's tail: cached context before it), sliding
    windows, GQA, head sizes from 32 to 256, row counts around the 16-row blocks; the error is
    the bf16 rounding of the weights and of the output."""
    g = torch.Generator().manual_seed(n * 1000 + ctx)
    q = torch.randn(n, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(ctx, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(ctx, hkv, d, generator=g).to(torch.bfloat16)
    scale = d ** -0.5 * 2.0
    out = torch.full((n, hq, d), float("nan"), dtype=torch.bfloat16)
    assert prefill_attention(q, k, v, out, scale, window or None)
    want, bound = _reference(q, k, v, scale, window)
    err = (out.double() - want).abs()
    assert (err <= 2 ** -7 * bound + 2 ** -8 * want.abs() + 1e-6).all(), err.max()


def test_prefill_attention_reads_strided_query_rows_and_writes_only_its_rows(isa):
    """q as a slice of a fused qkv projection (rows strided) and out a slice of the step's
    output: the rows around it are left alone."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(20, 6 * 32, generator=g).to(torch.bfloat16)  # 4 q heads, k, v of 32
    q = qkv[:, : 4 * 32].view(20, 4, 32)
    k = qkv[:, 4 * 32 : 5 * 32].reshape(20, 1, 32)
    v = qkv[:, 5 * 32 :].reshape(20, 1, 32)
    full = torch.zeros(30, 4, 32, dtype=torch.bfloat16)
    assert prefill_attention(q, k, v, full[5:25], 0.2)
    want, _ = _reference(q, k, v, 0.2, 0)
    assert (full[:5] == 0).all() and (full[25:] == 0).all()
    assert torch.allclose(full[5:25].double(), want, atol=2e-2)


def test_prefill_attention_declines_what_it_does_not_cover():
    """float32 tensors and head sizes that are not a multiple of 32: False (the caller runs SDPA)."""
    q = torch.randn(4, 2, 32)
    assert not prefill_attention(q, q, q, torch.empty_like(q), 1.0)
    q16 = torch.randn(4, 2, 48).to(torch.bfloat16)
    assert not prefill_attention(q16, q16, q16, torch.empty_like(q16), 1.0)


@pytest.mark.parametrize("n,window", [(53, 0), (53, 9), (150, 0), (150, 40), (800, 0), (800, 700)])
def test_a_row_is_the_same_whatever_chunk_or_trimmed_context_it_is_computed_in(isa, n, window):
    """Chunked prefill is exact on either ISA: each row's bits do not depend on the rows computed
    with it, and a sliding-window chunk given only the keys its queries reach (from an even
    position: attention/backends/torch_ref.py trims so) gives the same bits."""
    g = torch.Generator().manual_seed(9)
    hq, hkv, d = 4, 2, 64
    q = torch.randn(n, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(n, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(n, hkv, d, generator=g).to(torch.bfloat16)
    whole = torch.empty(n, hq, d, dtype=torch.bfloat16)
    assert prefill_attention(q, k, v, whole, 0.3, window or None)
    for cuts in ([0, 1, 17, 18, 40, n], [0, 5, 29, n], [0, n - 1, n], [c for c in (0, 37, 38, 101) if c < n] + [n]):
        for a, b in zip(cuts, cuts[1:]):
            first = (max(0, a - window + 1) & ~1) if window else 0
            part = torch.empty(b - a, hq, d, dtype=torch.bfloat16)
            assert prefill_attention(q[a:b], k[first:b], v[first:b], part, 0.3, window or None,
                                     key_start=first)
            assert torch.equal(part, whole[a:b]), (cuts, a, b)
