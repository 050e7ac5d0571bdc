"""The fused CPU RMSNorm (kernels.cpu_norm) and paged decode attention (kernels.cpu_attention)
against the eager torch formulas they replace."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.backends import torch_ref
from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_gemm import DISABLE_ENV
from pagedserve.kernels.cpu_attention import decode_attention
from pagedserve.kernels.cpu_norm import rms_norm
from pagedserve.platforms import TORCH_OPS
from pagedserve.layers.norms import GemmaRMSNorm, RMSNorm
from pagedserve.kernels.extension import kernels_disabled
from utils import attention_metadata


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here (no AVX2, no compiler, or disabled)")


def _eager(norm, x, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(norm, "ops", TORCH_OPS)  # the plain-torch ops: the eager formula
        return norm(x)


@pytest.mark.parametrize("cls", [GemmaRMSNorm, RMSNorm])
@pytest.mark.parametrize("shape", [(16, 640), (3, 4, 256), (5, 100), (7, 4096), (1, 16)])
def test_fused_rms_norm_matches_the_eager_formula(kernel, cls, shape, monkeypatch):
    torch.manual_seed(shape[-1])
    norm = cls(shape[-1])
    norm.weight.data.normal_()
    norm = norm.bfloat16()
    x = (torch.randn(*shape) * 3).bfloat16()
    with torch.inference_mode():
        fused, eager = norm(x), _eager(norm, x, monkeypatch)
    assert fused.shape == x.shape and fused.dtype == torch.bfloat16
    # Same formula; the fp32 sum of squares is added in another order: at most one bf16 step
    # apart, on a handful of elements.
    diff = (fused.float() - eager.float()).abs()
    assert (diff > 0).float().mean() < 0.001
    assert torch.all(diff <= eager.float().abs() * 2**-7 + 1e-6)


def test_fused_rms_norm_follows_reloaded_weights_and_skips_non_bf16(kernel, monkeypatch):
    norm = GemmaRMSNorm(64).bfloat16()
    x = torch.randn(4, 64).bfloat16()
    with torch.inference_mode():
        before = norm(x)
        with torch.no_grad():
            norm.weight.fill_(1.0)  # in place: the cached fp32 weight must be refreshed
        after = norm(x)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, _eager(norm, x, monkeypatch), atol=0, rtol=2**-7)
    assert rms_norm(x.float(), torch.ones(64), 1e-6, llama=False) is None


def _random_decode_batch(hq, hkv, d, bs, seed, num_seqs=5, nb=800, min_len=1, max_len=150):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(nb + 1, bs, hkv, d, generator=g).bfloat16()
    vc = torch.randn(nb + 1, bs, hkv, d, generator=g).bfloat16()
    kc[nb] = 0
    vc[nb] = 0
    lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    perm = rng.sample(range(nb), nb)
    tables, i = [], 0
    for n in lens:
        used = -(-n // bs)
        tables.append(perm[i : i + used])
        i += used
    meta = attention_metadata(block_tables=tables, seq_lens=lens, query_lens=[1] * num_seqs,
                              block_size=bs, null_block=nb)
    q = torch.randn(num_seqs, hq, d, generator=g).bfloat16()
    k = torch.randn(num_seqs, hkv, d, generator=g).bfloat16()
    v = torch.randn(num_seqs, hkv, d, generator=g).bfloat16()
    return q, k, v, kc, vc, meta


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 2), (3, 3), (34, 1)])
def test_decode_attention_is_bit_identical_alone_and_in_a_batch_at_any_thread_count(
        kernel, hq, hkv, threads):
    """Alone, a sequence's query heads are split across threads (fewer KV heads than threads);
    in a batch they are not: neither changes a bit."""
    q, _, _, kc, vc, meta = _random_decode_batch(hq, hkv, 64, 4, seed=hq + hkv, num_seqs=4)
    group = meta.groups[0]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        batch = decode_attention(q, kc, vc, group.block_tables, group.seq_lens, 0.1)
        for s in range(q.shape[0]):
            alone = decode_attention(q[s:s + 1], kc, vc, group.block_tables[s:s + 1],
                                     group.seq_lens[s:s + 1], 0.1)
            assert torch.equal(alone[0], batch[s]), f"sequence {s}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("hq,hkv,d,bs,window", [
    (4, 1, 256, 16, None),  # Gemma 3 270M's full layers
    (8, 2, 64, 16, 600),
    (5, 1, 96, 8, None),
])
def test_decode_attention_over_contexts_of_several_key_chunks_matches_sdpa(kernel, hq, hkv, d, bs,
                                                                          window, monkeypatch):
    """Contexts of 257-1,500 keys: the weighted sum of values runs in chunks of 256 keys
    (csrc/paged_attention_impl.h, kKeyChunk) with the partial sums kept between chunks; the
    result still matches the torch path's."""
    q, k, v, kc, vc, meta = _random_decode_batch(hq, hkv, d, bs, seed=hq * d + bs, nb=1200,
                                                 min_len=257, max_len=1500)
    fast = torch_ref.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.1, window)
    monkeypatch.setenv(DISABLE_ENV, "1")  # read on every call: the torch path from here on
    plain = torch_ref.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.1, window)
    torch.testing.assert_close(fast.float(), plain.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("hq,hkv,d,bs,window", [
    (4, 1, 256, 16, None),  # Gemma 3 270M
    (4, 1, 256, 16, 40),  # its sliding-window layers
    (8, 2, 64, 4, None),
    (6, 3, 80, 8, None),
    (2, 2, 128, 1, 7),
    (32, 1, 576, 16, None),  # MLA (DeepSeek V2): one latent "head" of 512 + 64 for 32 query heads
    (40, 2, 64, 4, 9),  # 20 query heads per KV head: runs of 16 and 4
])
def test_decode_attention_kernel_matches_gather_and_sdpa(kernel, hq, hkv, d, bs, window,
                                                        monkeypatch):
    q, k, v, kc, vc, meta = _random_decode_batch(hq, hkv, d, bs, seed=hq * d + bs)
    fast = torch_ref.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.1, window)
    monkeypatch.setenv(DISABLE_ENV, "1")  # read on every call: the torch path from here on
    plain = torch_ref.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.1, window)
    # fp32 throughout vs SDPA's bf16 path: within a bf16 step of values of size ~1
    torch.testing.assert_close(fast.float(), plain.float(), atol=1e-2, rtol=1e-2)


def test_decode_attention_declines_what_it_does_not_cover(kernel):
    q, _, _, kc, vc, meta = _random_decode_batch(4, 1, 256, 16, seed=1)
    group = meta.groups[0]
    assert decode_attention(q.float(), kc, vc, group.block_tables, group.seq_lens, 0.1) is None
    q72 = torch.randn(5, 4, 72).bfloat16()  # head size not a multiple of 16
    kc72 = torch.zeros(801, 16, 1, 72).bfloat16()
    assert decode_attention(q72, kc72, kc72, group.block_tables, group.seq_lens, 0.1) is None
    out = decode_attention(q, kc, vc, group.block_tables, group.seq_lens, 0.1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16


@pytest.mark.parametrize("hq,hkv,d,bs,window", [(8, 2, 64, 4, None), (4, 1, 64, 16, 9)])
def test_decode_attention_with_sinks_matches_the_torch_formula(kernel, hq, hkv, d, bs, window):
    """gpt-oss's sinks on the bf16 decode kernel: softmax([scores, sink])[:-1] V per query head,
    against `_attend_one`'s float32 torch products; a sink of -inf is no sink, bit for bit."""
    q, _, _, kc, vc, meta = _random_decode_batch(hq, hkv, d, bs, seed=hq + d)
    group = meta.groups[0]
    sinks = torch.linspace(-2.0, 3.0, hq)
    out = decode_attention(q, kc, vc, group.block_tables, group.seq_lens, 0.1, window, sinks)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    for s, ctx in enumerate(group.seq_lens.tolist()):
        first = max(0, ctx - window) if window else 0
        ref = torch_ref._attend_one(q[s], flat_k, flat_v, group.kv_slots[s, first:ctx], 0.1, sinks)
        torch.testing.assert_close(out[s].float(), ref, atol=1e-2, rtol=1e-2)
    plain = decode_attention(q, kc, vc, group.block_tables, group.seq_lens, 0.1, window)
    none = decode_attention(q, kc, vc, group.block_tables, group.seq_lens, 0.1, window,
                            torch.full((hq,), float("-inf")))
    assert torch.equal(none, plain)
    assert not torch.allclose(out.float(), plain.float(), atol=1e-2)  # the sinks take weight
    with pytest.raises(RuntimeError, match="sinks"):
        torch.ops.pagedserve_cpu.decode_attention.default(
            q, kc, vc, group.block_tables, group.seq_lens, 0.1, 0, cpu_gemm.linear_isa(),
            torch.zeros(hq + 1))
