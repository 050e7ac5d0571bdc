"""The fused q/k norm + RoPE CPU kernel (kernels.cpu_rotary, via layers.rotary.norm_and_rotate)
against the eager norm modules and `apply_rotary` it replaces."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_gemm, cpu_rotary
from pagedserve.platforms import cpu as platforms_cpu
from pagedserve.layers.norms import GemmaRMSNorm, RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary, norm_and_rotate
from pagedserve.kernels.extension import kernels_disabled


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")


def _inputs(t, hq, hkv, d, seed, theta=10000.0):
    torch.manual_seed(seed)
    q = (torch.randn(t, hq, d) * 2).bfloat16()
    k = (torch.randn(t, hkv, d) * 2).bfloat16()
    rope = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": theta}, 4096)
    positions = torch.randint(0, 4000, (t,))
    cos, sin = rope(positions, torch.bfloat16)
    return q, k, cos, sin


def _eager(q, k, cos, sin, q_norm, k_norm):
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(q, k, cos, sin)


@pytest.mark.parametrize("norm_cls", [None, GemmaRMSNorm, RMSNorm])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 1, 256), (7, 8, 2, 64), (33, 2, 2, 128), (2, 3, 3, 96)])
def test_fused_norm_and_rope_matches_the_eager_ops(kernel, norm_cls, t, hq, hkv, d):
    q, k, cos, sin = _inputs(t, hq, hkv, d, seed=t * d)
    q_norm = k_norm = None
    if norm_cls is not None:
        q_norm, k_norm = norm_cls(d), norm_cls(d)
        with torch.no_grad():
            q_norm.weight.normal_()
            k_norm.weight.normal_()
        q_norm, k_norm = q_norm.bfloat16(), k_norm.bfloat16()
    with torch.inference_mode():
        eq, ek = _eager(q, k, cos, sin, q_norm, k_norm)
        fq, fk = norm_and_rotate(q.clone(), k.clone(), cos, sin, q_norm, k_norm)
    for fused, eager in ((fq, eq), (fk, ek)):
        assert fused.dtype == torch.bfloat16 and fused.shape == eager.shape
        if norm_cls is None:  # no statistics: every rounding is the eager ops' own
            assert torch.equal(fused, eager)
        else:  # the norm's sum of squares in another order: a rare one-step difference
            diff = (fused.float() - eager.float()).abs()
            assert (diff > 0).float().mean() < 0.01
            assert torch.all(diff <= eager.float().abs() * 2**-6 + 2**-6)


def test_norm_and_rotate_runs_the_kernel_in_place_on_cpu_bf16(kernel, monkeypatch):
    q, k, cos, sin = _inputs(3, 4, 2, 64, seed=1)
    calls = []
    real = cpu_rotary.qk_norm_rope_
    monkeypatch.setattr(platforms_cpu, "qk_norm_rope_", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode():
        q2, k2 = norm_and_rotate(q, k, cos, sin)
    assert calls and q2 is q and k2 is k  # rotated in place, no copies


def test_norm_and_rotate_falls_back_to_eager_off_the_kernel(monkeypatch):
    q, k, cos, sin = _inputs(3, 4, 2, 64, seed=2)
    qf, kf, cf, sf = q.float(), k.float(), cos.float(), sin.float()
    q_norm, k_norm = GemmaRMSNorm(64), GemmaRMSNorm(64)
    with torch.inference_mode():
        fq, fk = norm_and_rotate(qf.clone(), kf.clone(), cf, sf, q_norm, k_norm)
        eq, ek = _eager(qf, kf, cf, sf, q_norm, k_norm)
    assert torch.equal(fq, eq) and torch.equal(fk, ek)
    # disabled kernels: the eager ops, and the inputs untouched
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "1")
    q0 = q.clone()
    with torch.inference_mode():
        fq, _ = norm_and_rotate(q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(fq, apply_rotary(q0, k, cos, sin)[0])


def test_the_kernel_rejects_shapes_it_does_not_handle(kernel):
    q, k, cos, sin = _inputs(2, 2, 1, 48, seed=3)  # head_dim 48: not a multiple of 32
    assert not cpu_rotary.qk_norm_rope_(q, k, cos, sin, None, None, 0.0, cpu_rotary.NORM_NONE)
    q, k, cos, sin = _inputs(2, 2, 1, 64, seed=3)
    assert not cpu_rotary.qk_norm_rope_(q.transpose(0, 1), k, cos, sin, None, None, 0.0, 0)
    with pytest.raises(RuntimeError, match="q_weight"):
        torch.ops.pagedserve_cpu.qk_norm_rope_.default(q, k, cos, sin, None, None, 1e-6, 1)
