"""The compiled CPU bf16 GEMV kernel (pagedserve.kernels.cpu_gemm) against torch's fp32 reference."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_gemm, extension
from pagedserve.kernels.cpu_isa import ISA_NONE
from pagedserve.kernels.extension import kernels_disabled


@pytest.fixture(scope="module")
def kernel():
    """Skip the module's kernel tests where the kernel cannot be built or used."""
    if kernels_disabled():
        pytest.skip(f"{cpu_gemm.DISABLE_ENV} is set")
    if cpu_gemm.linear_isa() == ISA_NONE:
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or build error)")
    return cpu_gemm


def _inputs(m, n, k, bias, seed=0, bias_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(bias_dtype) if bias else None
    return x, w, b


def _reference(x, w, b):
    """fp32 product of the same bf16 inputs."""
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


def _assert_matches(y, ref, out_dtype):
    if out_dtype == torch.float32:
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-3)
    else:  # one rounding of (nearly) the same fp32 sum to bf16
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)


# (M, N, K): tile tails in every dimension (W tiles of 4 / 16 / 64 rows, x tiles of 4 / 16 rows,
# K chunks of 32), plus Gemma 3 270M's layer shapes.
SHAPES = [
    (1, 1, 32),
    (1, 37, 64),
    (1, 40, 70),
    (2, 5, 31),
    (3, 50, 70),
    (4, 64, 640),
    (5, 67, 33),
    (7, 100, 1),
    (8, 130, 96),
    (13, 1024, 640),
    (16, 81, 640),
    (17, 64, 640),
    (24, 97, 128),
    (31, 48, 2048),
    (32, 256, 640),
    (33, 20, 64),
    (1, 640, 2048),
    (16, 2048, 640),
]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_fp32_reference(kernel, m, n, k, bias, out_dtype):
    x, w, b = _inputs(m, n, k, bias, seed=m * 1000 + n + k)
    y = kernel.bf16_linear(x, w, b, out_dtype)
    assert y.shape == (m, n)
    _assert_matches(y, _reference(x, w, b), out_dtype)


def test_random_shapes(kernel):
    g = torch.Generator().manual_seed(1234)
    for i in range(40):
        m = int(torch.randint(1, 34, (1,), generator=g))
        n = int(torch.randint(1, 300, (1,), generator=g))
        k = int(torch.randint(1, 9, (1,), generator=g)) * 32 + (0 if i % 2 else int(torch.randint(-31, 32, (1,), generator=g)))
        bias = bool(i % 3)
        out_dtype = torch.float32 if i % 4 < 2 else torch.bfloat16
        x, w, b = _inputs(m, n, k, bias, seed=i)
        _assert_matches(kernel.bf16_linear(x, w, b, out_dtype), _reference(x, w, b), out_dtype)


def test_bias_dtypes(kernel):
    x, w, b = _inputs(3, 40, 64, True, bias_dtype=torch.float32)
    ref = _reference(x, w, b)
    _assert_matches(kernel.bf16_linear(x, w, b, out_dtype=torch.float32), ref, torch.float32)


def test_public_api_uses_kernel_and_keeps_leading_dims(kernel, monkeypatch):
    x, w, b = _inputs(6, 70, 96, True)
    x3 = x.reshape(2, 3, 96)
    monkeypatch.setattr(cpu_gemm, "F", _NoLinear())  # the kernel path must not touch torch's linear
    y = kernel.bf16_linear(x3, w, b)
    assert y.shape == (2, 3, 70) and y.dtype == torch.bfloat16
    _assert_matches(y.reshape(6, 70), _reference(x, w, b), torch.bfloat16)
    # non-contiguous x is copied, not rejected
    xt = x.T.contiguous().T
    assert not xt.is_contiguous()
    _assert_matches(kernel.bf16_linear(xt, w, out_dtype=torch.float32), _reference(x, w, None), torch.float32)


def test_empty_and_degenerate(kernel):
    x, w, b = _inputs(2, 3, 0, True)
    y = kernel.bf16_linear(x, w, b, torch.float32)
    torch.testing.assert_close(y, b.float().expand(2, 3))
    x, w, _ = _inputs(2, 0, 32, False)
    assert kernel.bf16_linear(x, w).shape == (2, 0)


class _NoLinear:
    """Stands in for torch.nn.functional inside cpu_gemm: fails if the fallback is taken."""

    def linear(self, *args, **kwargs):
        raise AssertionError("fell back to F.linear")


class _SpyLinear:
    """Stands in for torch.nn.functional inside cpu_gemm: records fallback calls."""

    def __init__(self):
        self.calls = 0

    def linear(self, *args, **kwargs):
        self.calls += 1
        return F.linear(*args, **kwargs)


_BUILT_AMX = 4  # the extension's state once built on a CPU with AMX (kernels.cpu_isa.ISA_AMX)


def test_disabled_by_env_var_falls_back(monkeypatch):
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "1")
    monkeypatch.setattr(cpu_gemm._EXTENSION, "_isa", _BUILT_AMX)
    spy = _SpyLinear()
    monkeypatch.setattr(cpu_gemm, "F", spy)
    assert not cpu_gemm.kernel_available()
    x, w, b = _inputs(2, 10, 64, True)
    y = cpu_gemm.bf16_linear(x, w, b)
    assert spy.calls == 1
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)
    y32 = cpu_gemm.bf16_linear(x, w, b, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and spy.calls == 2


@pytest.mark.parametrize("case", ["fp32", "grad", "non_contiguous_weight"])
def test_fallback_cases(monkeypatch, case):
    monkeypatch.delenv(cpu_gemm.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm._EXTENSION, "_isa", _BUILT_AMX)
    spy = _SpyLinear()
    monkeypatch.setattr(cpu_gemm, "F", spy)
    x, w, b = _inputs(3, 10, 64, True)
    if case == "fp32":
        x, w, b = x.float(), w.float(), b.float()
    elif case == "grad":
        w = w.clone().requires_grad_(True)
    elif case == "non_contiguous_weight":
        w = torch.randn(64, 10).to(torch.bfloat16).T
    y = cpu_gemm.bf16_linear(x, w, b)
    assert spy.calls == 1
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 4, 5, 32, 33, 200])
def test_every_row_count_takes_the_one_kernel(kernel, monkeypatch, rows):
    """No row count goes to torch (whose reduction order differs): a row's result must not
    depend on how many rows its batch has."""
    monkeypatch.setattr(cpu_gemm, "F", _NoLinear())
    x, w, b = _inputs(rows, 70, 96, True, seed=rows)
    y = kernel.bf16_linear(x, w, b, out_dtype=torch.float32)
    _assert_matches(y, _reference(x, w, b), torch.float32)
    assert torch.equal(kernel.bf16_linear(x[-1:], w, b, out_dtype=torch.float32)[0], y[-1])


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.delenv(cpu_gemm.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm._EXTENSION, "_isa", None)

    def broken_build():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_gemm._EXTENSION, "_build", broken_build)
    x, w, b = _inputs(2, 10, 64, True)
    with caplog.at_level(logging.WARNING, logger=extension.logger.name):
        for _ in range(3):
            torch.testing.assert_close(cpu_gemm.bf16_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
        assert not cpu_gemm.kernel_available()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()


def test_lazy_build_is_thread_safe(kernel, monkeypatch):
    """Two threads hitting an unbuilt kernel at once: one build, both get the kernel's result."""
    real_build = cpu_gemm._EXTENSION._build
    calls = []

    def slow_build():
        calls.append(threading.get_ident())
        time.sleep(0.2)  # widen the race window
        return real_build()

    monkeypatch.setattr(cpu_gemm._EXTENSION, "_isa", None)
    monkeypatch.setattr(cpu_gemm._EXTENSION, "_build", slow_build)
    x, w, b = _inputs(5, 33, 96, True)
    ref = _reference(x, w, b)
    barrier = threading.Barrier(2)
    results, errors = [None, None], []

    def worker(i):
        try:
            barrier.wait()
            results[i] = cpu_gemm.bf16_linear(x, w, b, out_dtype=torch.float32)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(calls) == 1
    for y in results:
        _assert_matches(y, ref, torch.float32)


def test_misuse_raises_value_error():
    x, w, b = _inputs(2, 10, 64, True)
    with pytest.raises(ValueError):
        cpu_gemm.bf16_linear(x[:, :32], w)  # K mismatch
    with pytest.raises(ValueError):
        cpu_gemm.bf16_linear(x, w[0])  # 1-D weight
    with pytest.raises(ValueError):
        cpu_gemm.bf16_linear(x, w, b[:5])  # bias length
    with pytest.raises(ValueError):
        cpu_gemm.bf16_linear(x, w, out_dtype=torch.float16)


def test_import_does_not_build():
    code = (
        "import pagedserve.kernels, pagedserve.kernels.cpu_gemm as c, torch; "
        "assert c._EXTENSION._isa is None; assert not hasattr(torch.ops.pagedserve_cpu, 'argmax_bf16')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("rows,padded", [(33, 64), (100, 128), (128, 128), (161, 192), (5, 5)])
def test_low_precision_products_above_32_rows_go_to_torch_padded_to_64_rows(monkeypatch, rows, padded):
    """Bounded oneDNN primitive caches (see cpu_gemm.PAD_ROWS): torch sees row counts in
    multiples of 64 above 32 rows; the result is the unpadded product."""
    monkeypatch.setenv(cpu_gemm.DISABLE_ENV, "1")  # every product goes to torch
    seen = []
    real = F.linear

    class Spy:
        @staticmethod
        def linear(x, w, b=None):
            seen.append(x.numel() // x.shape[-1])
            return real(x, w, b)

    monkeypatch.setattr(cpu_gemm, "F", Spy)
    torch.manual_seed(rows)
    x = torch.randn(1, rows, 64).to(torch.bfloat16)
    w = torch.randn(48, 64).to(torch.bfloat16)
    b = torch.randn(48).to(torch.bfloat16)
    y = cpu_gemm.bf16_linear(x, w, b)
    assert seen == [padded] and y.shape == (1, rows, 48) and y.is_contiguous()
    torch.testing.assert_close(y, real(x, w, b), rtol=2**-7, atol=1e-2)
    assert cpu_gemm.bf16_linear(x.float(), w.float()).shape == (1, rows, 48)
    assert seen[-1] == rows  # fp32 (not oneDNN's per-shape cache): never padded


def test_extension_build_folder_is_named_by_a_hash_of_the_sources(tmp_path, monkeypatch):
    """Two source trees on one machine never share (and rebuild back and forth) a build folder."""
    src = tmp_path / "k.cpp"
    src.write_text("int a;")
    ext = cpu_gemm._EXTENSION
    monkeypatch.setattr(ext, "sources", [src])
    first = ext.build_name()
    assert first.startswith("pagedserve_cpu_kernels_") and first == ext.build_name()
    src.write_text("int b;")
    second = ext.build_name()
    assert second != first
    # a second source tree with the same sources gets its own folder too (build.ninja holds paths)
    monkeypatch.setattr(extension, "CSRC", tmp_path / "other_checkout")
    assert ext.build_name() != second


@pytest.mark.parametrize("t,heads,k,n", [(1, 16, 128, 512), (3, 4, 64, 130), (17, 5, 512, 96), (70, 2, 32, 64)])
def test_linear_heads_equals_the_loop_over_heads_bit_for_bit(kernel, t, heads, k, n):
    """MLA's per-head products in one call: each head's result is `bf16_linear`'s for that head
    (a strided x[:, h], its weight), whatever the row count and the column tiles."""
    g = torch.Generator().manual_seed(t * heads + n)
    x = torch.randn(t, heads, k, generator=g).bfloat16()
    w = torch.randn(heads, n, k, generator=g).bfloat16()
    got = cpu_gemm.linear_heads(x, w)
    want = torch.stack([cpu_gemm.bf16_linear(x[:, h], w[h]) for h in range(heads)], dim=1)
    assert got is not None and got.shape == (t, heads, n)
    assert torch.equal(got, want)
    assert cpu_gemm.linear_heads(x.float(), w.float()) is None  # not bf16: the caller's loop
    with pytest.raises(ValueError, match="Hh"):
        cpu_gemm.linear_heads(x, w[:1])
