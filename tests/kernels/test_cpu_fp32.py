"""The batch-invariant float32 CPU kernels (pagedserve.kernels.cpu_fp32): a row's bits do not
depend on the rows around it, the tiling, the thread count or the ISA; attention of a query is the
same whether computed in a prompt chunk (fresh or over cached context, any split) or as a decode
row; both match a float64 reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.backends import torch_ref
from pagedserve.kernels import cpu_fp32
from pagedserve.layers import linear as linear_layers
from utils import attention_metadata

ROW_COUNTS = [1, 2, 3, 5, 16, 17, 64, 300]


@pytest.fixture(scope="module")
def kernels():
    """Skip the module where the kernels cannot be built or used."""
    if not cpu_fp32.fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable (disabled, no AVX2/AVX-512, or build failed)")
    return cpu_fp32


def _isas():
    best = cpu_fp32.best_isa()
    return ["avx2", "avx512"] if best == "avx512" else ["avx2"]


def _linear_inputs(m, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("n,k,bias", [(1152, 2048, False), (2048, 640, True), (640, 2048, False),
                                      (128, 64, True), (37, 93, True), (6, 16, False)])
def test_linear_row_is_bitwise_the_same_for_every_row_count(kernels, n, k, bias):
    x, w, b = _linear_inputs(max(ROW_COUNTS), n, k, bias, seed=n + k)
    full = kernels.invariant_linear(x, w, b)  # [300, N]
    for m in ROW_COUNTS:
        assert torch.equal(kernels.invariant_linear(x[:m], w, b), full[:m]), f"M={m}"
        # the same rows at other places of a batch
        tail = x[-m:]
        assert torch.equal(kernels.invariant_linear(tail, w, b), full[-m:]), f"last M={m}"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernels.invariant_linear(x[perm], w, b), full[perm])


@pytest.mark.parametrize("seed", range(6))
def test_linear_random_shapes_are_row_invariant_and_match_float64(kernels, seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 300), rng.choice([1, 7, 15, 16, 17, 64, 100, 640, 1000, 2048])
    x, w, b = _linear_inputs(rng.randint(20, 130), n, k, bias=seed % 2 == 0, seed=seed)
    full = kernels.invariant_linear(x, w, b)
    for m in (1, 2, 3, 5, 16, 17):
        start = rng.randint(0, x.shape[0] - m)
        assert torch.equal(kernels.invariant_linear(x[start : start + m], w, b), full[start : start + m])
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)


def test_linear_is_bitwise_the_same_on_every_isa_and_thread_count(kernels):
    x, w, b = _linear_inputs(70, 301, 650, True, seed=5)
    ref = kernels._kernel_linear(x, w, b, isa="avx2")
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for isa in _isas():
                assert torch.equal(kernels._kernel_linear(x, w, b, isa=isa), ref), (isa, t)
    finally:
        torch.set_num_threads(threads)


def test_linear_keeps_leading_dims_and_declines_what_it_does_not_cover(kernels):
    x, w, b = _linear_inputs(12, 20, 24, True)
    y = kernels.invariant_linear(x.view(3, 4, 24), w, b)
    assert y.shape == (3, 4, 20) and torch.equal(y.view(12, 20), kernels.invariant_linear(x, w, b))
    assert kernels.invariant_linear(x.bfloat16(), w.bfloat16()) is None
    assert kernels.invariant_linear(x, w.double()) is None
    assert kernels.invariant_linear(x, w.requires_grad_()) is None  # autograd: torch's path
    w.requires_grad_(False)
    with torch.no_grad():
        assert kernels.invariant_linear(x, w.requires_grad_()) is not None


def test_model_linear_uses_the_kernel_for_float32_and_torch_when_disabled(kernels, monkeypatch):
    x, w, b = _linear_inputs(5, 33, 64, True)
    assert torch.equal(linear_layers.linear(x, w, b), kernels._kernel_linear(x, w, b))
    monkeypatch.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")
    assert torch.equal(linear_layers.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("name,ref", [("silu", F.silu),
                                      ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
                                      ("sigmoid", torch.sigmoid)])  # MoE gates (layers/moe.py)
def test_activation_element_is_bitwise_the_same_whatever_the_tensor_size(kernels, name, ref):
    x = torch.randn(3 * 40_000 + 7, generator=torch.Generator().manual_seed(0)) * 4
    x[:6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    full = kernels.invariant_activation(x, name)
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            for isa in _isas():
                assert torch.equal(kernels._kernel_activation(x, name, isa), full), (isa, t)
    finally:
        torch.set_num_threads(threads)
    for i in (0, 15, 31, 32, 40_001, x.numel() - 1):
        assert torch.equal(kernels.invariant_activation(x[i : i + 1], name), full[i : i + 1])
    assert torch.equal(kernels.invariant_activation(x[5:2000], name), full[5:2000])
    torch.testing.assert_close(full, ref(x), rtol=1e-6, atol=1e-6)
    assert kernels.invariant_activation(x.half(), name) is None


@pytest.mark.parametrize("name,ref", [("silu", F.silu),
                                      ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_bf16_activation_is_the_fp32_formula_rounded_once_at_every_size_and_isa(kernels, name, ref):
    x = (torch.randn(2 * 40_000 + 5, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    x[:4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    x[4] = float("nan")
    full = kernels.invariant_activation(x, name)
    assert full.dtype is torch.bfloat16
    # the fp32 kernel on the widened values, rounded to nearest even by torch
    want = kernels.invariant_activation(x.float(), name).bfloat16()
    assert torch.equal(full[5:], want[5:]) and torch.equal(full[:4], want[:4])
    assert torch.isnan(full[4])
    for isa in _isas():
        assert torch.equal(kernels._kernel_activation(x, name, isa)[5:], want[5:]), isa
    for i in (5, 20, 40_001, x.numel() - 1):
        assert torch.equal(kernels.invariant_activation(x[i : i + 1], name), full[i : i + 1])
    # torch's bf16 op: the same values within one bf16 step
    torch.testing.assert_close(full[5:].float(), ref(x[5:]).float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_gated_activation_has_the_bits_of_the_activation_then_the_product(kernels, dtype, name):
    """act(gate) * up in one pass equals the activation kernel followed by torch's product, bit
    for bit, at every row count and width (tails of 1-15), on column views of one fused
    projection's output, at every ISA; bf16 rounds the activation before the product."""
    g = torch.Generator().manual_seed(3)
    for t, n in ((1, 7), (3, 16), (5, 33), (17, 2048), (64, 1000)):
        fused = (torch.randn(t, 2 * n + 3, generator=g) * 4).to(dtype)
        fused[0, :4] = torch.tensor([0.0, -0.0, 60.0, -60.0])
        gate, up = fused[:, :n], fused[:, n : 2 * n]  # strided rows, as linear_outputs' split gives
        want = kernels.invariant_activation(gate.contiguous(), name) * up
        got = kernels.invariant_gated_activation(gate, up, name)
        assert got.dtype is dtype and got.is_contiguous()
        assert torch.equal(got, want), (t, n)
        for isa in _isas():
            op = torch.ops.pagedserve_fp32.fp32_gated_activation.default
            assert torch.equal(op(gate, up, kernels.ACTIVATIONS[name], kernels.ISAS[isa]), want), (isa, t, n)
    x = torch.randn(4, 8)
    assert kernels.invariant_gated_activation(x.half(), x.half(), name) is None
    assert kernels.invariant_gated_activation(x, x.bfloat16(), name) is None
    assert kernels.invariant_gated_activation(x.t(), x.t(), name) is None  # columns not contiguous


def test_gated_mlp_runs_the_fused_middle_and_keeps_its_bits(kernels, monkeypatch):
    """A gated MLP on the CPU platform calls the one-pass kernel, and its output is the same bits
    as the activation then the product (the path before the kernel)."""
    from pagedserve.models.llama import LlamaMLP
    from pagedserve.platforms import cpu as cpu_platform

    torch.manual_seed(0)
    mlp = LlamaMLP(64, 160, "gelu_pytorch_tanh").bfloat16()
    x = torch.randn(9, 64).bfloat16()
    calls = []
    real = cpu_platform.invariant_gated_activation
    monkeypatch.setattr(cpu_platform, "invariant_gated_activation",
                        lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = mlp(x)
        monkeypatch.setattr(cpu_platform, "invariant_gated_activation", lambda *a: None)
        want = mlp(x)
    assert calls and torch.equal(got, want)


# ---- attention ------------------------------------------------------------------------------


class _Seq:
    """A sequence's per-position q/k/v (fixed up front, as the layers would compute them)."""

    def __init__(self, length, hq, hkv, d, g):
        self.length = length
        self.q = torch.randn(length, hq, d, generator=g)
        self.k = torch.randn(length, hkv, d, generator=g)
        self.v = torch.randn(length, hkv, d, generator=g)


def _run_steps(seqs, steps, hq, hkv, d, bs, window, seed, softcap=None):
    """Run `steps` (each a list of (seq index, start, stop) chunks) through the torch backend on a
    fresh NaN-filled cache with shuffled blocks; returns {seq index: [L, Hq, D] outputs}."""
    nb = sum(-(-s.length // bs) for s in seqs) + 3
    kc = torch.full((nb + 1, bs, hkv, d), float("nan"))
    vc = torch.full((nb + 1, bs, hkv, d), float("nan"))
    kc[nb] = 0
    vc[nb] = 0
    free = random.Random(seed).sample(range(nb), nb)
    tables = {i: [free.pop() for _ in range(-(-s.length // bs))] for i, s in enumerate(seqs)}
    outs = {i: torch.full((s.length, hq, d), float("nan")) for i, s in enumerate(seqs)}
    for step in steps:
        meta = attention_metadata(
            block_tables=[tables[i][: -(-stop // bs)] for i, _, stop in step],
            seq_lens=[stop for _, _, stop in step], query_lens=[stop - start for _, start, stop in step],
            block_size=bs, null_block=nb)
        q = torch.cat([seqs[i].q[a:b] for i, a, b in step])
        k = torch.cat([seqs[i].k[a:b] for i, a, b in step])
        v = torch.cat([seqs[i].v[a:b] for i, a, b in step])
        o = torch_ref.paged_attention(q, k, v, kc, vc, meta, 0.3, window, softcap=softcap)
        row = 0
        for i, a, b in step:
            outs[i][a:b] = o[row : row + b - a]
            row += b - a
    return outs


def _reference(seq, window, scale=0.3, softcap=None):
    """float64 causal (windowed, soft-capped) attention of every position of `seq`."""
    L, hq, d = seq.q.shape
    hkv = seq.k.shape[1]
    k = seq.k.double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
    v = seq.v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", seq.q.double() * scale, k)  # [Hq, L, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    mask = kp <= qp
    if window:
        mask &= qp - kp < window
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("hq,hkv,d,bs,window,softcap", [
    (4, 2, 16, 4, None, None),  # the tiny llama
    (4, 1, 32, 4, 6, None),  # tiny Gemma 3's sliding layers
    (4, 4, 20, 3, None, None),  # head size not a multiple of 16
    (8, 2, 64, 8, 5, None),
    (4, 1, 256, 16, None, None),  # Gemma 3 270M
    (4, 2, 32, 4, 6, 1.5),  # Gemma 2's soft-capped scores
])
def test_attention_of_a_query_is_bitwise_the_same_in_any_chunk_or_decode_row(
        kernels, hq, hkv, d, bs, window, softcap):
    g = torch.Generator().manual_seed(hq * d + bs)
    L = 23
    seqs = [_Seq(L, hq, hkv, d, g), _Seq(9, hq, hkv, d, g), _Seq(30, hq, hkv, d, g)]
    scenarios = {
        "one fresh prompt": [[(0, 0, L)]],
        "chunks": [[(0, 0, 5)], [(0, 5, 6)], [(0, 6, 17)], [(0, 17, L)]],
        "decode rows": [[(0, i, i + 1)] for i in range(L)],
        "prompt then decode": [[(0, 0, 10)]] + [[(0, i, i + 1)] for i in range(10, L)],
        # mixed steps: others' prompt chunks and decode rows around the target's
        "mixed": [[(1, 0, 9), (0, 0, 4), (2, 0, 7)], [(0, 4, 12), (2, 7, 8)],
                  [(2, 8, 30), (0, 12, 13)], [(0, 13, L)]],
    }
    results = {name: _run_steps(seqs, steps, hq, hkv, d, bs, window, seed=j, softcap=softcap)[0]
               for j, (name, steps) in enumerate(scenarios.items())}
    first = results["one fresh prompt"]
    assert not first.isnan().any()
    for name, out in results.items():
        assert torch.equal(out, first), name
    torch.testing.assert_close(first.double(), _reference(seqs[0], window, softcap=softcap), rtol=1e-5, atol=1e-5)


def test_attention_is_bitwise_the_same_on_every_isa_and_thread_count(kernels):
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, bs = 6, 2, 40, 4
    kc = torch.randn(9, bs, hkv, d, generator=g)
    vc = torch.randn(9, bs, hkv, d, generator=g)
    q = torch.randn(11, hq, d, generator=g)
    tables = torch.tensor([[3, 1, 7, 0, 2], [5, 4, 6, 8, 8]])
    lens, qsl = torch.tensor([17, 9]), torch.tensor([0, 5, 11])
    ref = kernels._kernel_attention(q, kc, vc, tables, lens, qsl, 0.2, 0, isa="avx2")
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for isa in _isas():
                got = kernels._kernel_attention(q, kc, vc, tables, lens, qsl, 0.2, 0, isa=isa)
                assert torch.equal(got, ref), (isa, t)
    finally:
        torch.set_num_threads(threads)


def test_attention_declines_what_it_does_not_cover(kernels):
    q = torch.randn(2, 4, 16)
    kc = torch.randn(3, 4, 2, 16)
    bt, sl, qsl = torch.tensor([[0, 1]]), torch.tensor([5]), torch.tensor([0, 2])
    assert kernels.invariant_attention(q.bfloat16(), kc, kc, bt, sl, qsl, 0.1) is None
    assert kernels.invariant_attention(q, kc.bfloat16(), kc.bfloat16(), bt, sl, qsl, 0.1) is None
    assert kernels.invariant_attention(q[:, :3], kc, kc, bt, sl, qsl, 0.1) is None  # 3 heads on 2
    assert kernels.invariant_attention(q, kc, kc, bt, sl, qsl, 0.1).shape == (2, 4, 16)
