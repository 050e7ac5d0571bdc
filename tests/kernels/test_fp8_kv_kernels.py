"""fp8 KV blocks (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) below the engine: the conversion on
write (rounded, saturated), the kernels' convert-on-load (every byte widened as torch reads it,
at every ISA), the kernels' bits equal to the same values in a wide cache, and the cache's block
copies / swaps / fills through byte views."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.kv_dtype import kv_cache_dtype, to_cache
from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_fp32 import _kernel_attention, best_isa
from pagedserve.kernels.cpu_isa import ISA_AVX2, ISA_AVX512BF16
from pagedserve.kernels.extension import kernels_disabled

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp32_isas() -> list[str]:
    best = best_isa()
    if best is None:
        pytest.skip("float32 CPU kernels unavailable here")
    return ["avx2", "avx512"] if best == "avx512" else ["avx2"]


def _bf16_isas() -> list[int]:
    if kernels_disabled() or not cpu_gemm.kernel_available():
        pytest.skip("CPU kernels unavailable here")
    return [ISA_AVX2, ISA_AVX512BF16] if cpu_gemm._cpu_isa() >= ISA_AVX512BF16 else [ISA_AVX2]


def test_vllm_names_map_to_torch_fp8_and_writes_saturate():
    assert kv_cache_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn  # vLLM: fp8 = e4m3
    assert kv_cache_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("fp8_inc", torch.bfloat16)
    x = torch.tensor([1e6, -1e6, float("inf"), float("nan"), 0.3])
    e4, e5 = to_cache(x, torch.float8_e4m3fn).float(), to_cache(x, torch.float8_e5m2).float()
    assert e4[:3].tolist() == [448.0, -448.0, 448.0] and e4[3].isnan()
    assert e5[:3].tolist() == [57344.0, -57344.0, 57344.0] and e5[3].isnan()  # never inf
    assert e4[4] == torch.tensor(0.3).to(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("dtype", FP8)
def test_every_fp8_byte_is_widened_as_torch_reads_it_at_every_isa(dtype):
    # One key, so softmax weight 1: each kernel's output is the value row itself, widened.
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).view(1, 1, 1, 256)  # V: every byte
    k = torch.zeros(2, 1, 1, 256, dtype=dtype)
    v = torch.cat([codes, torch.zeros_like(codes)])
    want = codes.float().view(1, 1, 256)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    for isa in _fp32_isas():
        got = _kernel_attention(torch.ones(1, 1, 256), k, v, tables, lens,
                                torch.tensor([0, 1]), 1.0, isa=isa)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    for isa in _bf16_isas():
        got = torch.ops.pagedserve_cpu.decode_attention(
            torch.ones(1, 1, 256, dtype=torch.bfloat16), k, v, tables, lens, 1.0, 0, isa)
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("window", [0, 9])
def test_fp8_caches_give_the_bits_of_wide_caches_holding_the_same_values(dtype, window):
    torch.manual_seed(window)
    n, b, hkv, d = 6, 8, 2, 48  # d: not a multiple of 16 (the float32 kernel's tail)
    k = to_cache(torch.randn(n, b, hkv, d) * 2, dtype)
    v = to_cache(torch.randn(n, b, hkv, d), dtype)
    tables = torch.tensor([[0, 3, 5], [4, 1, 2]])
    lens, starts = torch.tensor([21, 13]), torch.tensor([0, 5, 8])  # a 5-token chunk, 3 decodes
    q = torch.randn(8, 4, d)
    for isa in _fp32_isas():
        assert torch.equal(
            _kernel_attention(q, k, v, tables, lens, starts, 0.3, window, isa=isa),
            _kernel_attention(q, k.float(), v.float(), tables, lens, starts, 0.3, window, isa=isa))
    d = 64  # the bf16 decode kernel: head size a multiple of 16
    k = to_cache(torch.randn(n, b, hkv, d) * 2, dtype)
    v = to_cache(torch.randn(n, b, hkv, d), dtype)
    qb = torch.randn(2, 4, d).bfloat16()
    for isa in _bf16_isas():
        run = lambda kc, vc: torch.ops.pagedserve_cpu.decode_attention(  # noqa: E731
            qb, kc, vc, tables, lens, 0.2, window, isa)
        assert torch.equal(run(k, v), run(k.bfloat16(), v.bfloat16()))


def test_fp8_cache_writes_copies_swaps_and_fills_move_the_bytes():
    from pagedserve.attention.backends.torch_ref import write_kv
    from pagedserve.models.base import KVCacheSpec
    from pagedserve.worker.kv_cache import KVCache, bytes_per_block

    spec = KVCacheSpec(2, 2, 16)
    assert bytes_per_block(spec, 4, torch.float8_e5m2) * 2 == bytes_per_block(spec, 4, torch.bfloat16)
    cache = KVCache(spec, 6, 4, torch.float8_e5m2, torch.device("cpu"), num_cpu_blocks=3)
    assert cache.slots[0][0].dtype is torch.float8_e5m2
    key, value = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    slots = torch.arange(4, 12)  # blocks 1 and 2
    for k, v in cache.layers:
        write_kv(key, value, k, v, slots)
    k0 = cache.layers[1][0]
    assert torch.equal(k0.view(-1, 2, 16)[4:12].float(), to_cache(key, k0.dtype).float())
    cache.copy_blocks([(1, 3)])  # copy-on-write
    cache.swap_out([(2, 0)])
    cache.fill_blocks([2], float("nan"))
    assert k0[2].float().isnan().all()
    cache.swap_in([(0, 4)])
    assert torch.equal(k0[3].float(), to_cache(key[:4], k0.dtype).float())  # the copy of block 1
    assert torch.equal(k0[4].float(), to_cache(key[4:], k0.dtype).float())
    assert torch.equal(cache.layers[0][1][3].float(), to_cache(value[:4], k0.dtype).float())


def _reference_attention(q, ks, vs, scale, window):
    """Causal attention in float64 of each sequence's queries (the last of its context) over
    its whole context `ks[i]` / `vs[i]` ([ctx, Hkv, D], already what the cache holds)."""
    outs = []
    for qi, k, v in zip(q, ks, vs):
        n, hq, d = qi.shape
        ctx, hkv = k.shape[0], k.shape[1]
        k = k.double().repeat_interleave(hq // hkv, dim=1)  # [ctx, Hq, D]
        v = v.double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("nhd,chd->hnc", qi.double(), k) * scale  # [Hq, n, ctx]
        q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        allowed = k_pos <= q_pos
        if window:
            allowed &= q_pos - k_pos < window
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("hnc,chd->nhd", p, v))
    return torch.cat(outs)


# (cached before the step, new this step) per sequence: a fresh prompt, a prompt's second chunk,
# two decode rows
_STEP = [(0, 5), (6, 4), (9, 1), (2, 1)]


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("window", [None, 3])
def test_fp8_prefill_and_decode_attention_equal_a_quantize_dequantize_reference(
        model_dtype, dtype, window):
    # A mixed step (prompt chunks and decode rows) through the torch backend with the CPU ops:
    # the float32 kernel (float32 model), or the bf16 prefill / decode kernels (bf16 model),
    # over fp8 blocks, against float64 attention over K/V quantized to fp8 by torch's own
    # conversion and widened back. Tolerances: float32 2e-6 + 1e-6 |x| (the kernel's fp32
    # arithmetic: errors seen ~7e-7); bf16 4e-3 + 2^-8 |x| (the output rounded to bf16, softmax
    # weights rounded to bf16 for the product with V on AVX512-BF16).
    from pagedserve.attention.backends.torch_ref import paged_attention, write_kv
    from pagedserve.platforms import CPU_OPS
    from utils import attention_metadata

    torch.manual_seed(4 * FP8.index(dtype) + 2 * (model_dtype is torch.bfloat16) + bool(window))
    bs, nb, hq, hkv, d = 4, 16, 4, 2, 64
    k_cache = torch.zeros(nb + 1, bs, hkv, d, dtype=dtype)  # block nb: the null block
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(nb).tolist()
    tables, ctx_k, ctx_v, queries, new_k, new_v = [], [], [], [], [], []
    for before, n in _STEP:
        ctx = before + n
        table = [free.pop() for _ in range(-(-ctx // bs))]
        tables.append(table)
        k = (torch.randn(ctx, hkv, d) * 3).to(model_dtype)  # beyond e4m3's fine steps
        v = torch.randn(ctx, hkv, d).to(model_dtype)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(before)], dtype=torch.long)
        write_kv(k[:before], v[:before], k_cache, v_cache, slots)  # the context already cached
        ctx_k.append(k), ctx_v.append(v)
        new_k.append(k[before:]), new_v.append(v[before:])
        queries.append(torch.randn(n, hq, d).to(model_dtype))
    meta = attention_metadata(block_tables=tables, seq_lens=[b + n for b, n in _STEP],
                              query_lens=[n for _, n in _STEP], block_size=bs,
                              null_block=nb)
    scale = d ** -0.5
    out = paged_attention(torch.cat(queries), torch.cat(new_k), torch.cat(new_v), k_cache,
                          v_cache, meta, scale, window, ops=CPU_OPS)
    assert out.dtype is model_dtype
    # the reference: torch's fp8 conversion of every K/V, widened back
    want = _reference_attention(queries, [k.to(dtype) for k in ctx_k],
                                [v.to(dtype) for v in ctx_v], scale, window)
    rtol, atol = (1e-6, 2e-6) if model_dtype is torch.float32 else (2 ** -8, 4e-3)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    # ... and the tolerance sees the quantization: without it the reference is far away
    unquantized = _reference_attention(queries, ctx_k, ctx_v, scale, window)
    assert (out.double() - unquantized).abs().max().item() > 0.1
