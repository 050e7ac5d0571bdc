"""The bf16 decode kernels (norm, q/k norm + RoPE, paged decode attention, argmax) are built for
AVX2 and for AVX-512 on one 16-lane vector type (csrc/vec16.h): every ISA level this CPU runs
must give the same bits, so a request's tokens do not change with the machine's ISA."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_isa import ISA_AMX, ISA_AVX2, ISA_AVX512BF16, ISA_NAMES
from pagedserve.kernels.extension import kernels_disabled

OPS = torch.ops.pagedserve_cpu


@pytest.fixture(scope="module")
def levels() -> list[int]:
    """Every ISA level of this CPU whose decode kernels differ (AVX2 build, AVX-512 build)."""
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")
    best = cpu_gemm._cpu_isa()
    if best < ISA_AVX512BF16:
        pytest.skip(f"one build here (best ISA {ISA_NAMES[best]}): needs a CPU with AVX512-BF16")
    return [ISA_AVX2, ISA_AVX512BF16]


def _same_at_every_level(levels, run):
    results = [run(isa) for isa in levels]
    for isa, got in zip(levels[1:], results[1:]):
        for a, b in zip(results[0] if isinstance(results[0], tuple) else (results[0],),
                        got if isinstance(got, tuple) else (got,)):
            assert torch.equal(a, b), f"{ISA_NAMES[isa]} differs from avx2"


@pytest.mark.parametrize("h", [640, 100, 16, 4096])
@pytest.mark.parametrize("llama", [False, True])
def test_rms_norm_is_bit_identical_at_every_isa(levels, h, llama):
    torch.manual_seed(h)
    x = (torch.randn(9, h) * 3).bfloat16()
    w = torch.randn(h)
    _same_at_every_level(levels, lambda isa: OPS.rms_norm(x, w, 1e-6, llama, isa))


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_qk_norm_rope_is_bit_identical_at_every_isa(levels, norm):
    torch.manual_seed(norm)
    q, k = (torch.randn(5, 4, 256) * 2).bfloat16(), (torch.randn(5, 1, 256) * 2).bfloat16()
    cos, sin = torch.randn(5, 256).bfloat16(), torch.randn(5, 256).bfloat16()
    qw, kw = (torch.randn(256), torch.randn(256)) if norm else (None, None)

    def run(isa):
        q2, k2 = q.clone(), k.clone()
        OPS.qk_norm_rope_(q2, k2, cos, sin, qw, kw, 1e-6, norm, isa)
        return q2, k2

    _same_at_every_level(levels, run)


@pytest.mark.parametrize("window,lens", [(0, [1, 13, 24]), (7, [1, 13, 24]),
                                         (0, [300, 1000, 1300]), (700, [300, 1000, 1300])])
def test_decode_attention_is_bit_identical_at_every_isa(levels, window, lens):
    """Short contexts and contexts of several chunks of keys (the weighted sum of values runs
    256 keys at a time, partial sums kept between chunks)."""
    torch.manual_seed(window)
    bs, hkv, d = 4, 2, 64
    used = -(-max(lens) // bs)  # blocks of the longest
    num_blocks = used * 2
    kc, vc = torch.randn(num_blocks, bs, hkv, d).bfloat16(), torch.randn(num_blocks, bs, hkv, d).bfloat16()
    tables = torch.stack([torch.randperm(num_blocks)[:used] for _ in range(3)])  # [3, used]
    lens = torch.tensor(lens)
    q = torch.randn(3, 8, d).bfloat16()
    _same_at_every_level(levels, lambda isa: OPS.decode_attention(q, kc, vc, tables, lens, 0.125, window, isa))


@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 256), (8, 2, 128), (16, 1, 576)])
@pytest.mark.parametrize("window", [0, 100])
def test_decode_attention_on_amx_cpus_has_the_avx2_bits(levels, hq, hkv, d, window):
    """AMX CPUs run decode attention on vectors, not tiles (csrc/paged_attention.cpp's NOTE): the
    same bits as AVX2, at the shapes tiles would take (blocks of 16 slots, head_dim a multiple
    of 32: Gemma 3's 4 x 256 over one KV head, DeepSeek's latent 576)."""
    if cpu_gemm._cpu_isa() < ISA_AMX:
        pytest.skip("needs a CPU with AMX")
    torch.manual_seed(hq + d + window)
    bs, lens = 16, [1, 15, 16, 17, 210, 700]
    used = -(-max(lens) // bs)
    num_blocks = used * 2
    kc, vc = torch.randn(num_blocks, bs, hkv, d).bfloat16(), torch.randn(num_blocks, bs, hkv, d).bfloat16()
    tables = torch.stack([torch.randperm(num_blocks)[:used] for _ in lens])
    q = torch.randn(len(lens), hq, d).bfloat16()
    _same_at_every_level([*levels, ISA_AMX], lambda isa: OPS.decode_attention(
        q, kc, vc, tables, torch.tensor(lens), d ** -0.5, window, isa))


def test_argmax_is_bit_identical_at_every_isa(levels):
    torch.manual_seed(0)
    x = torch.randn(4, 70001).bfloat16()
    x[1, 5] = x[1, 40000] = 100.0  # a tie across pieces
    x[2, 33] = float("nan")
    _same_at_every_level(levels, lambda isa: OPS.argmax_bf16(x, isa))


@pytest.mark.parametrize("k,w,n", [(640, 48, 1024), (100, 24, 37)])
def test_lora_shrink_and_expand_are_bit_identical_at_every_isa(levels, k, w, n):
    """LoRA's per-token kernels (csrc/lora_bgmv.cpp), whole vectors and tails."""
    torch.manual_seed(k)
    x = torch.randn(7, k).bfloat16()
    a_t = (torch.randn(3, k, w) * 0.1).bfloat16()
    b_t = (torch.randn(3, w // 3, n) * 0.1).bfloat16()
    slots = torch.tensor([2, -1, 0, 1, 2, 0, -1])
    y = torch.randn(7, n).bfloat16()

    def run(isa):
        h = OPS.lora_shrink(x, a_t, slots, isa)
        y2 = y.clone()
        OPS.lora_expand_(y2, h, w // 3, b_t, slots, isa)
        return h, y2

    _same_at_every_level(levels, run)
