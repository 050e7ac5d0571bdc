"""The CUDA platform's Triton layer kernels (kernels/triton_layers.py) equal the eager formulas of
layers.norms and layers.rotary: RMSNorm (Llama and Gemma numerics) and per-head q/k norm + RoPE
in place. On CUDA compiled (`pytest -m gpu`); without it under Triton's interpreter on CPU."""

from triton_tests import DEVICE, triton_marks  # noqa: I001 (first: before triton is imported)

import pytest
import torch

pytestmark = triton_marks()

from pagedserve.kernels import triton_layers
from pagedserve.layers.norms import GemmaRMSNorm, RMSNorm
from pagedserve.layers.rotary import apply_rotary
from pagedserve.platforms import TORCH_OPS
from pagedserve.platforms.cuda import CudaLayerOps


def _norm(cls, h, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = cls(h, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=gen) * 0.5 + (0.0 if cls is GemmaRMSNorm else 1.0))
    norm.ops = TORCH_OPS  # the eager formula
    return norm.to(device=DEVICE, dtype=dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of the 16-bit dtype's last place at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max())


@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("h", [64, 96, 640])
def test_rms_norm_equals_the_eager_formula(cls, h):
    dtype = torch.bfloat16
    norm = _norm(cls, h, dtype, seed=h)
    x = (torch.randn(5, 3, h, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE, dtype)
    with torch.no_grad():
        want = norm(x)
    w32, eps, numerics = norm.kernel_args(dtype)
    got = triton_layers.rms_norm(x, w32, eps, numerics)
    assert got.shape == x.shape and got.dtype == dtype
    # NOTE: only the order of the sum of squares differs: within an ulp, and mostly equal
    assert _ulps(got, want) <= 1.0
    assert (got == want).float().mean() > 0.95


def test_rms_norm_declines_what_it_does_not_compute():
    w = torch.ones(8, device=DEVICE)
    assert triton_layers.rms_norm(torch.ones(2, 8, device=DEVICE), w, 1e-6, "llama") is None
    half = torch.ones(2, 8, device=DEVICE, dtype=torch.float16)
    assert triton_layers.rms_norm(half, w, 1e-6, "llama") is None
    x = torch.ones(2, 8, device=DEVICE, dtype=torch.bfloat16)
    assert triton_layers.rms_norm(x, w, 1e-6, "other") is None
    assert triton_layers.rms_norm(x, w[:4], 1e-6, "llama") is None
    assert triton_layers.rms_norm(x[:0], w, 1e-6, "llama").shape == (0, 8)


def _rope_tables(t, d, dtype, seed):
    pos = torch.arange(t, dtype=torch.float32)[:, None] + seed
    freqs = pos / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("numerics", [None, "llama", "gemma"])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_qk_norm_rope_in_place_equals_norm_then_apply_rotary(numerics, d):
    t, hq, hkv, dtype = 7, 4, 2, torch.bfloat16
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(t, hq, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(DEVICE, dtype)
    cos, sin = _rope_tables(t, d, dtype, seed=3)
    if numerics is None:
        want_q, want_k = apply_rotary(q, k, cos, sin)
        weights = (None, None)
    else:
        cls = GemmaRMSNorm if numerics == "gemma" else RMSNorm
        qn, kn = _norm(cls, d, dtype, seed=1), _norm(cls, d, dtype, seed=2)
        with torch.no_grad():
            want_q, want_k = apply_rotary(qn(q), kn(k), cos, sin)
        offset = 1.0 if numerics == "gemma" else 0.0
        weights = (qn.weight.float() + offset, kn.weight.float() + offset)
    q2, k2 = q.clone(), k.clone()
    assert triton_layers.qk_norm_rope_(q2, k2, cos, sin, *weights, 1e-6, numerics)
    if numerics is None:  # no statistic: bit for bit
        assert torch.equal(q2, want_q) and torch.equal(k2, want_k)
    else:
        for got, want in ((q2, want_q), (k2, want_k)):
            assert (got == want).float().mean() > 0.9
            assert _ulps(got, want) <= 2.0


def test_qk_rope_of_strided_heads_and_decline_cases():
    t, d = 3, 64
    cos, sin = _rope_tables(t, d, torch.bfloat16, seed=0)
    qkv = torch.randn(t, 4 * d, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.bfloat16)
    q, k = qkv[:, :2 * d].view(t, 2, d), qkv[:, 2 * d:3 * d].view(t, 1, d)  # views of one row
    want_q, want_k = apply_rotary(q, k, cos, sin)
    v_before = qkv[:, 3 * d:].clone()
    assert triton_layers.qk_norm_rope_(q, k, cos, sin, None, None, 0.0, None)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 3 * d:], v_before)  # the rest of the row untouched
    f32 = torch.zeros(t, 2, d, device=DEVICE)
    assert not triton_layers.qk_norm_rope_(f32, f32[:, :1], cos.float(), sin.float(), None, None,
                                           0.0, None)
    assert not triton_layers.qk_norm_rope_(q, k, cos[:, : d // 2], sin[:, : d // 2], None, None,
                                           0.0, None)  # partial RoPE stays on apply_rotary
    assert not triton_layers.qk_norm_rope_(q, k, cos, sin, None, None, 1e-6, "llama")  # no weights
    h16 = torch.zeros(t, 2, d, device=DEVICE, dtype=torch.float16)
    assert not triton_layers.qk_norm_rope_(h16, h16[:, :1], cos.half(), sin.half(), None, None,
                                           0.0, None)


def test_cuda_layer_ops_take_only_cuda_tensors():
    ops = CudaLayerOps()
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    w = torch.ones(8)
    if DEVICE == "cpu":
        assert ops.rms_norm(x, w, 1e-6, "llama") is None
        assert not ops.qk_norm_rope_(x.view(2, 1, 8), x.view(2, 1, 8), x, x, None, None, 0.0, None)
    else:
        assert ops.rms_norm(x.cuda(), w.cuda(), 1e-6, "llama") is not None


@pytest.mark.parametrize("n", [40, 2048, 5000])
def test_silu_and_mul_of_fused_halves_equals_torch(n):
    gen = torch.Generator().manual_seed(n)
    fused = (torch.randn(6, 2 * n, generator=gen) * 4).to(DEVICE, torch.bfloat16)  # gate|up
    gate, up = fused.split(n, dim=-1)  # column views, as a fused gate|up product gives
    want = torch.nn.functional.silu(gate) * up
    got = triton_layers.silu_and_mul(gate, up)
    assert got.shape == want.shape and got.is_contiguous()
    assert _ulps(got, want) <= 1.0  # the exponential: an fp32 ulp at most
    assert (got == want).float().mean() > 0.99
    assert triton_layers.silu_and_mul(gate.float(), up.float()) is None
    assert triton_layers.silu_and_mul(gate, up[:, :-1]) is None


class _AnyDeviceOps(CudaLayerOps):
    """The CUDA platform's ops on this test's DEVICE (CPU under the interpreter)."""

    def rms_norm(self, x, weight_f32, eps, numerics):
        return triton_layers.rms_norm(x, weight_f32, eps, numerics)

    def qk_norm_rope_(self, query, key, cos, sin, q_weight, k_weight, eps, numerics):
        return triton_layers.qk_norm_rope_(query, key, cos, sin, q_weight, k_weight, eps, numerics)

    def gated_activation(self, gate, up, name):
        return triton_layers.silu_and_mul(gate, up) if name == "silu" else None


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_model_on_the_cuda_platform_ops_and_fused_projections_keeps_greedy_tokens(arch):
    """A tiny bf16 model bound as the CUDA platform binds it (Triton norms and q/k norm + RoPE,
    q|k|v and gate|up re-homed into one GEMM each) against the same weights on torch's ops:
    equal greedy tokens over a chunked prefill and 6 decode steps, and equal last logits (on
    CPU bit for bit; on CUDA within bf16 noise)."""
    import tiny
    from utils import PagedRunner

    from pagedserve.models.loader import load_model
    from pagedserve.platforms.base import Platform
    from pagedserve.platforms.cuda import CudaPlatform

    config = tiny.config_for(arch)
    plain = Platform(DEVICE)  # torch's ops, nothing fused
    cuda_like = CudaPlatform(DEVICE)
    cuda_like.ops = _AnyDeviceOps()
    models = {name: load_model(config, weights=None, dtype=torch.bfloat16, device=DEVICE, seed=0,
                               platform=p) for name, p in (("torch", plain), ("cuda", cuda_like))}
    attn = next(m for m in models["cuda"].modules() if hasattr(m, "q_proj"))
    assert attn.q_proj.__dict__.get("_fused") is not None  # fused, sharing one buffer
    assert attn.q_proj.weight.untyped_storage().data_ptr() == \
        attn.v_proj.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in models["cuda"].parameters()) == \
        sum(p.numel() for p in models["torch"].parameters())
    runners = {n: PagedRunner(m, block_size=4, num_blocks=24, device=DEVICE, backend="torch")
               for n, m in models.items()}
    prompt = [5, 17, 99, 3, 42, 7, 8, 250, 31]
    tokens = {}
    for name, runner in runners.items():
        logits = runner.step([(0, prompt[:5])])[0]
        logits = runner.step([(0, prompt[5:])])[0]
        out, last = [], logits[-1]
        for _ in range(6):
            out.append(int(last.argmax()))
            last = runner.step([(0, [out[-1]])])[0][-1]
        tokens[name] = (out, last)
    assert tokens["cuda"][0] == tokens["torch"][0]
    got, want = tokens["cuda"][1], tokens["torch"][1]
    if DEVICE == "cpu":  # one GEMM kernel family, the interpreter's exact casts: bit for bit
        assert torch.equal(got, want)
    else:  # cuBLAS picks other kernels for the fused GEMM's width
        assert float((got - want).abs().max()) <= 0.02 * float(want.std())
