"""The triton backend equals the torch reference: write_kv, paged attention (mixed prefill-chunk +
decode batches, GQA, sliding window, head sizes 64..256, split-K on/off), copy_blocks, and a tiny
Llama end to end. On CUDA the kernels are compiled; without CUDA they run under Triton's
interpreter (`TRITON_INTERPRET=1`, set before triton is imported), so shapes stay tiny."""

import math
import random

from triton_tests import DEVICE, triton_marks  # noqa: I001 (first: before triton is imported)

import pytest
import torch

pytestmark = triton_marks()

import tiny
from utils import PagedRunner, attention_metadata

from pagedserve.attention.backends import torch_ref, triton_attn
from pagedserve.attention.backends.torch_meta import TorchAttentionMetadata
from pagedserve.platforms import platform_for
from pagedserve.models.loader import load_model

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _caches(num_blocks, block_size, hkv, d, dtype):
    """NaN-filled caches (reading an unwritten slot poisons the output) with a zero null block."""
    k = torch.full((num_blocks + 1, block_size, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    v = torch.full_like(k, float("nan"))
    k[num_blocks] = 0
    v[num_blocks] = 0
    return k, v


def _batch(shapes, hq, hkv, d, block_size, dtype, seed):
    """Random shuffled block tables; each sequence's first `cached` positions already written.
    `shapes`: (cached, new) per sequence. Returns caches, q/k/v of the new tokens and both
    backends' metadata."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in shapes) + 3
    k_cache, v_cache = _caches(num_blocks, block_size, hkv, d, dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, seq_lens, query_lens = [], [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(math.ceil((cached + new) / block_size))]
        for p in range(cached):
            k_cache[table[p // block_size], p % block_size] = torch.randn(hkv, d, generator=gen).to(dtype)
            v_cache[table[p // block_size], p % block_size] = torch.randn(hkv, d, generator=gen).to(dtype)
        tables.append(table)
        seq_lens.append(cached + new)
        query_lens.append(new)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
    metas = {
        b: attention_metadata(
            b, block_tables=tables, seq_lens=seq_lens, query_lens=query_lens,
            block_size=block_size, null_block=num_blocks, device=DEVICE,
        )
        for b in ("torch", "triton")
    }
    return k_cache, v_cache, q, k, v, metas


MIXED = [(0, 7), (9, 1), (3, 4), (12, 1), (0, 1), (17, 3)]  # prompt chunks and decode rows
DECODE = [(21, 1), (5, 1), (40, 1)]

CASES = [
    # shapes, hq, hkv, d, block_size, window, dtype, num_splits
    (MIXED, 4, 2, 64, 16, None, torch.float32, 1),
    (MIXED, 4, 2, 64, 16, None, torch.float32, 3),
    (MIXED, 4, 4, 80, 8, None, torch.float32, 1),
    (MIXED, 6, 2, 96, 3, 5, torch.float32, 1),
    (MIXED, 4, 1, 128, 1, 4, torch.float32, 2),
    (MIXED, 2, 1, 256, 8, None, torch.float32, 1),
    (DECODE, 8, 2, 64, 16, None, torch.float32, 4),
    (DECODE, 8, 2, 64, 4, 9, torch.float32, 4),
    (DECODE, 7, 1, 80, 16, None, torch.float32, 1),
    (MIXED, 4, 2, 64, 16, 6, torch.bfloat16, 1),
    (MIXED, 4, 2, 128, 8, None, torch.bfloat16, 2),
    (DECODE, 4, 1, 256, 16, None, torch.bfloat16, 4),
    (MIXED, 4, 2, 64, 16, None, torch.float16, 1),
]


@pytest.mark.parametrize("shapes,hq,hkv,d,block_size,window,dtype,num_splits", CASES)
def test_paged_attention_matches_torch_ref(shapes, hq, hkv, d, block_size, window, dtype, num_splits):
    k_cache, v_cache, q, k, v, metas = _batch(shapes, hq, hkv, d, block_size, dtype, seed=d + hq)
    k2, v2 = k_cache.clone(), v_cache.clone()
    ref = torch_ref.paged_attention(q, k, v, k_cache, v_cache, metas["torch"], 0.125, window)
    out = triton_attn.paged_attention(q, k, v, k2, v2, metas["triton"], 0.125, window, num_splits=num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # Both wrote the new K/V to the same slots.
    torch.testing.assert_close(k2, k_cache, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v2, v_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("shapes,num_splits,dtype", [(MIXED, 1, torch.float32), (DECODE, 4, torch.float32),
                                                     (MIXED, 1, torch.bfloat16)])
def test_softcapped_attention_matches_torch_ref(shapes, num_splits, dtype):
    k_cache, v_cache, q, k, v, metas = _batch(shapes, 4, 2, 64, 8, dtype, seed=5)
    k2, v2 = k_cache.clone(), v_cache.clone()
    ref = torch_ref.paged_attention(q, k, v, k_cache, v_cache, metas["torch"], 0.3, 6, softcap=2.0)
    out = triton_attn.paged_attention(q, k, v, k2, v2, metas["triton"], 0.3, 6, num_splits=num_splits,
                                      softcap=2.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    uncapped = torch_ref.paged_attention(q, k, v, k_cache, v_cache, metas["torch"], 0.3, 6)
    assert not torch.allclose(uncapped.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_split_k_heuristic_and_auto_path():
    shapes = [(1100, 1)]  # one long decode row: the heuristic splits it
    k_cache, v_cache, q, k, v, metas = _batch(shapes, 2, 1, 64, 16, torch.float32, seed=3)
    meta = metas["triton"]
    assert meta.max_seq_len == 1101 and meta.max_query_len == 1
    assert triton_attn.choose_num_splits(meta, num_kv_heads=1) > 1
    ref = torch_ref.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), metas["torch"], 0.125)
    out = triton_attn.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # Prompt chunks, short contexts, many programs: no split; meta.num_splits overrides.
    mixed = _batch(MIXED, 4, 2, 64, 16, torch.float32, seed=0)[-1]["triton"]
    assert triton_attn.choose_num_splits(mixed, num_kv_heads=2) == 1
    mixed.num_splits = 8
    assert triton_attn.choose_num_splits(mixed, num_kv_heads=2) == 8


@pytest.mark.parametrize("block_size", [1, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_torch_ref(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    hkv, d, t, num_blocks = 2, 80, 11, 12
    k_ref, v_ref = _caches(num_blocks, block_size, hkv, d, dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(DEVICE)
    key = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEVICE)
    torch_ref.write_kv(key, value, k_ref, v_ref, slots)
    triton_attn.write_kv(key, value, k_tri, v_tri, slots)
    torch.testing.assert_close(k_tri, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_tri, v_ref, equal_nan=True, atol=0, rtol=0)


def test_write_kv_skips_padded_rows_and_casts_to_cache_dtype():
    hkv, d, block_size = 1, 64, 4
    k_cache, v_cache = _caches(4, block_size, hkv, d, torch.bfloat16)
    before = k_cache.clone()
    key = torch.randn(3, hkv, d, device=DEVICE)  # fp32 into a bf16 cache
    slots = torch.tensor([5, -1, 2], device=DEVICE)
    triton_attn.write_kv(key, key * 2, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[5], key[0].bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(flat_k[2], key[2].bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(flat_v[2], (key[2] * 2).bfloat16(), atol=0, rtol=0)
    untouched = [s for s in range(flat_k.shape[0]) if s not in (2, 5)]
    torch.testing.assert_close(flat_k[untouched], before.view(-1, hkv, d)[untouched], equal_nan=True, atol=0, rtol=0)
    with pytest.raises(ValueError):
        triton_attn.write_kv(key, key, k_cache, v_cache, slots[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_torch_ref(dtype):
    gen = torch.Generator().manual_seed(0)
    layers_ref = [
        tuple(torch.randn(9, 3, 2, 80, generator=gen).to(dtype).to(DEVICE) for _ in range(2)) for _ in range(2)
    ]
    layers_tri = [(k.clone(), v.clone()) for k, v in layers_ref]
    src = torch.tensor([0, 4, 4], device=DEVICE)
    dst = torch.tensor([7, 2, 5], device=DEVICE)
    torch_ref.copy_blocks(layers_ref, src, dst)
    triton_attn.copy_blocks(layers_tri, src, dst)
    for (kr, vr), (kt, vt) in zip(layers_ref, layers_tri):
        torch.testing.assert_close(kt, kr, atol=0, rtol=0)
        torch.testing.assert_close(vt, vr, atol=0, rtol=0)
    with pytest.raises(ValueError):
        triton_attn.copy_blocks(layers_tri, src, dst[:2])


def test_each_backend_builds_its_own_metadata_and_backend_selection():
    kw = {"block_tables": [[0, 1], [2]], "seq_lens": [5, 1], "query_lens": [2, 1], "block_size": 4, "null_block": 3}
    torch_meta = attention_metadata("torch", **kw)
    tri_meta = attention_metadata("triton", **kw, num_splits=2)
    assert isinstance(torch_meta, TorchAttentionMetadata) and torch_meta.groups
    assert isinstance(torch_meta.impl, torch_ref.TorchAttentionBackend)
    assert isinstance(tri_meta, triton_attn.TritonAttentionMetadata)
    assert isinstance(tri_meta.impl, triton_attn.TritonAttentionBackend)
    assert not hasattr(tri_meta, "groups") and tri_meta.num_splits == 2
    assert not hasattr(torch_meta, "num_splits")
    assert (tri_meta.max_seq_len, tri_meta.max_query_len) == (5, 2)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(tri_meta, name), getattr(torch_meta, name)), name
    with pytest.raises(ValueError):
        attention_metadata("flash", **kw)
    q = torch.zeros(3, 2, 8)
    kv = torch.zeros(3, 1, 8)
    cache = torch.zeros(4, 4, 1, 8)
    with pytest.raises(ValueError, match="groups"):  # the torch backend cannot run triton's metadata
        torch_ref.paged_attention(q, kv, kv, cache, cache.clone(), tri_meta, 1.0)

    cpu = platform_for("cpu")
    assert isinstance(cpu.attention_backend("torch"), torch_ref.TorchAttentionBackend)
    assert isinstance(cpu.attention_backend("triton"), triton_attn.TritonAttentionBackend)
    assert cpu.resolve_attention_backend("auto") == "torch"
    assert platform_for(DEVICE).resolve_attention_backend("auto") == (
        "triton" if DEVICE == "cuda" else "torch")
    assert platform_for("cuda").resolve_attention_backend("auto") == "triton"  # triton imports here
    with pytest.raises(ValueError):
        cpu.attention_backend("flash")


@torch.inference_mode()
def test_tiny_llama_greedy_equal_across_backends():
    """A tiny Llama (GQA) run step by step on paged caches: a chunked prefill of two prompts, a
    mixed step, then greedy decode; the triton backend's logits and tokens equal torch's."""
    model = load_model(tiny.config_for("llama"), weights=None, dtype=torch.float32, device=DEVICE, seed=0)
    runners = {b: PagedRunner(model, block_size=4, num_blocks=24, device=DEVICE, backend=b)
               for b in ("torch", "triton")}

    def step(backend, batch):  # batch: [(seq_id, tokens)] -> logits [n_new, V] per sequence
        return runners[backend].step(batch)

    prompts = [[5, 17, 99, 3, 42, 7, 8, 250, 31], [11, 12, 400]]
    steps = [[(0, prompts[0][:5]), (1, prompts[1])], [(0, prompts[0][5:])]]
    outs = {b: [step(b, batch) for batch in steps] for b in ("torch", "triton")}
    for ref_step, tri_step in zip(outs["torch"], outs["triton"]):
        for ref, tri in zip(ref_step, tri_step):
            torch.testing.assert_close(tri, ref, atol=1e-4, rtol=1e-4)
    last = {0: outs["torch"][1][0][-1].argmax().item(), 1: outs["torch"][0][1][-1].argmax().item()}
    generated = {b: {0: [], 1: []} for b in ("torch", "triton")}
    for b in ("torch", "triton"):
        nxt = dict(last)
        for _ in range(6):
            logits = step(b, [(s, [nxt[s]]) for s in (0, 1)])
            for s, lg in zip((0, 1), logits):
                nxt[s] = lg[-1].argmax().item()
                generated[b][s].append(nxt[s])
    assert generated["triton"] == generated["torch"]
