"""The torch paged-attention backend equals dense causal attention on contiguous K/V."""

import math
import random

import pytest
import torch

from pagedserve.attention.backends.torch_ref import paged_attention
from utils import attention_metadata


def _dense(q, k, v, scale, window, softcap=None):  # q [L, Hq, D] for the last len(q) positions of k/v [S, Hkv, D]
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = k.shape[0]
    qpos = torch.arange(s - q.shape[0], s).unsqueeze(1)
    kpos = torch.arange(s).unsqueeze(0)
    mask = kpos <= qpos
    if window:
        mask &= qpos - kpos < window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


MIXED = [(0, 7), (9, 1), (3, 4), (12, 1), (0, 1)]
DECODE_ONLY = [(9, 1), (0, 1), (20, 1), (4, 1)]  # built by AttentionMetadata._build_decode
FRESH = [(0, 7), (9, 1), (0, 4), (0, 12)]  # prompts with nothing cached: causal over their own K/V
FRESH_SHORT = [(0, 5), (6, 1), (0, 3)]  # ... within the window of 5 too


@pytest.mark.parametrize("shapes", [MIXED, DECODE_ONLY, FRESH, FRESH_SHORT],
                         ids=["mixed", "decode-only", "fresh", "fresh-short"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_attention(window, block_size, shapes):
    _check_against_dense(window, block_size, shapes)


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shapes", [MIXED, DECODE_ONLY], ids=["mixed", "decode-only"])
@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_attention_matches_dense_attention(monkeypatch, kernels, dtype, shapes, window):
    """Gemma 2's attention soft-capping, on every path: the float32 kernel, the bf16 steps (which
    the compiled bf16 kernels leave to torch) and the torch paths."""
    if kernels == "torch":
        monkeypatch.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")
    _check_against_dense(window, 4, shapes, softcap=1.5, dtype=dtype)


def _check_against_dense(window, block_size, shapes, softcap=None, dtype=torch.float32):
    torch.manual_seed(0)
    rng = random.Random(block_size)
    hq, hkv, d = 4, 2, 8
    num_blocks = 64
    k_cache = torch.full((num_blocks + 1, block_size, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[num_blocks] = 0
    v_cache[num_blocks] = 0
    free = list(range(num_blocks))
    rng.shuffle(free)
    # shapes: (context already cached, new query tokens)
    seqs = []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        k_all = torch.randn(total, hkv, d)
        v_all = torch.randn(total, hkv, d)
        for p in range(cached):
            k_cache[table[p // block_size], p % block_size] = k_all[p]
            v_cache[table[p // block_size], p % block_size] = v_all[p]
        seqs.append((table, total, new, k_all, v_all, torch.randn(new, hq, d)))
    meta = attention_metadata(
        block_tables=[s[0] for s in seqs],
        seq_lens=[s[1] for s in seqs],
        query_lens=[s[2] for s in seqs],
        block_size=block_size,
        null_block=num_blocks,
    )
    # Prompt chunks are attended one by one: (flat start, query length, context length) each.
    [prompt_spans] = [g.spans for g in meta.groups if g.is_prompt] or [None]
    starts = [sum(n for _, n in shapes[:i]) for i in range(len(shapes))]
    expected = [(starts[i], n, c + n) for i, (c, n) in enumerate(shapes) if n > 1]
    assert prompt_spans == (expected or None)
    q = torch.cat([s[5] for s in seqs])
    k = torch.cat([s[3][s[1] - s[2]:] for s in seqs])
    v = torch.cat([s[4][s[1] - s[2]:] for s in seqs])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    out = paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), k_cache.to(dtype), v_cache.to(dtype),
                          meta, scale=0.3, sliding_window=window, softcap=softcap)
    start, capped = 0, False
    for table, total, new, k_all, v_all, qs in seqs:
        ref = _dense(qs, k_all, v_all, 0.3, window, softcap)
        capped |= not torch.allclose(ref, _dense(qs, k_all, v_all, 0.3, window), atol=tol, rtol=tol)
        torch.testing.assert_close(out[start:start + new].float(), ref, atol=tol, rtol=tol)
        start += new
    assert capped == bool(softcap)  # the cap matters: without it the results are others


@pytest.mark.parametrize(
    "query_lens,covers_all", [([1, 1, 1], True), ([1], True), ([1, 3, 1], False), ([4, 2], False)]
)
def test_only_decode_only_steps_mark_their_group_as_covering_the_batch(query_lens, covers_all):
    n = len(query_lens)
    meta = attention_metadata(
        block_tables=[[i] for i in range(n)], seq_lens=[5] * n, query_lens=query_lens,
        block_size=8, null_block=n,
    )
    assert [g.covers_all for g in meta.groups] == [covers_all] + [False] * (len(meta.groups) - 1)
    if covers_all:
        assert torch.equal(meta.groups[0].out_tokens, torch.arange(n))


def test_decode_only_metadata_equals_the_general_build():
    from pagedserve.attention.backends.torch_meta import _group

    tables = [[7, 3, 9], [2], [5, 6], [8, 1, 4, 0]]
    lens = [10, 1, 8, 13]
    bs, null = 4, 11
    meta = attention_metadata(block_tables=tables, seq_lens=lens, query_lens=[1] * 4,
                              block_size=bs, null_block=null)
    n = len(lens)
    bt = torch.tensor([t + [null] * (4 - len(t)) for t in tables])
    sl = torch.tensor(lens)
    general = _group(torch.arange(n), bt, sl, bs, null, "cpu", out_tokens=torch.arange(n))
    assert meta.slot_mapping.tolist() == [t[(x - 1) // bs] * bs + (x - 1) % bs
                                          for t, x in zip(tables, lens)]
    assert torch.equal(meta.block_tables, bt) and torch.equal(meta.seq_lens, sl)
    assert meta.query_start_loc.tolist() == list(range(n + 1))
    assert (meta.num_tokens, meta.max_seq_len, meta.max_query_len) == (n, 13, 1)
    [group] = meta.groups
    for name in ("out_tokens", "kv_slots", "seq_lens", "block_tables"):
        assert torch.equal(getattr(group, name), getattr(general, name)), name
    assert group.max_len == general.max_len == 13 and not group.is_prompt

    assert group.kv_slots[1].tolist() == [2 * bs] + [null * bs] * 12  # padding -> the null block
    with pytest.raises(ValueError, match="seq_len"):
        attention_metadata(block_tables=[[1]], seq_lens=[5], query_lens=[1], block_size=4,
                           null_block=9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 3])
def test_a_decode_row_is_bit_identical_alone_and_beside_longer_rows(monkeypatch, dtype, window):
    """The torch path attends each decode row over exactly its own context: a row's bits must not
    depend on the longest context in its batch."""
    monkeypatch.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")  # the torch path, not the kernels
    torch.manual_seed(0)
    bs, hq, hkv, d, nblocks = 4, 4, 2, 16, 12
    k_cache = torch.randn(nblocks + 1, bs, hkv, d).to(dtype)
    v_cache = torch.randn(nblocks + 1, bs, hkv, d).to(dtype)
    tables, lens = [[0, 1], [2, 3, 4, 5, 6, 7, 8, 9], [10]], [6, 31, 3]
    q = torch.randn(3, hq, d).to(dtype)
    k_new, v_new = torch.randn(3, hkv, d).to(dtype), torch.randn(3, hkv, d).to(dtype)

    def attend(rows):
        meta = attention_metadata(block_tables=[tables[i] for i in rows],
                                  seq_lens=[lens[i] for i in rows], query_lens=[1] * len(rows),
                                  block_size=bs, null_block=nblocks)
        return paged_attention(q[rows], k_new[rows], v_new[rows], k_cache.clone(), v_cache.clone(),
                               meta, scale=0.25, sliding_window=window)

    batch = attend([0, 1, 2])
    for i in range(3):
        assert torch.equal(attend([i])[0], batch[i]), i


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("shapes", [[(6, 4), (9, 1), (0, 3)], [(6, 4), (9, 1), (2, 3)]],
                         ids=["mixed", "decode-only"])
def test_a_decode_row_of_several_tokens_is_attended_token_by_token(monkeypatch, kernels, window,
                                                                   shapes):
    """Speculative rows: a decode row of q tokens (`decode_rows`) is q decode entries, causal
    within the row, each bit-identical to the same token as a one-token decode row."""
    if kernels == "torch":
        monkeypatch.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")
    torch.manual_seed(0)
    bs, hq, hkv, d, nblocks = 4, 4, 2, 16, 16
    dtype = torch.bfloat16
    k_cache = torch.randn(nblocks + 1, bs, hkv, d).to(dtype)
    v_cache = torch.randn(nblocks + 1, bs, hkv, d).to(dtype)
    k_cache[nblocks] = 0
    v_cache[nblocks] = 0
    tables = [[0, 1, 2], [3, 4, 5], [6, 7]]
    decode_rows = [c > 0 for c, _ in shapes]
    lens = [c + n for c, n in shapes]
    qlens = [n for _, n in shapes]
    total = sum(qlens)
    q = torch.randn(total, hq, d).to(dtype)
    k_new, v_new = torch.randn(total, hkv, d).to(dtype), torch.randn(total, hkv, d).to(dtype)
    meta = attention_metadata(block_tables=tables, seq_lens=lens, query_lens=qlens,
                              block_size=bs, null_block=nblocks, decode_rows=decode_rows)
    decode = [g for g in meta.groups if not g.is_prompt][0]
    assert decode.covers_all == all(decode_rows)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = paged_attention(q, k_new, v_new, kc, vc, meta, scale=0.25, sliding_window=window)
    # Each token of the decode rows as a one-token decode row over the cache as written.
    start = 0
    for i, (c, n) in enumerate(shapes):
        if decode_rows[i]:
            for t in range(n):
                one = attention_metadata(block_tables=[tables[i]], seq_lens=[c + t + 1],
                                         query_lens=[1], block_size=bs, null_block=nblocks)
                ref = paged_attention(q[start + t:start + t + 1], k_new[start + t:start + t + 1],
                                      v_new[start + t:start + t + 1], kc.clone(), vc.clone(),
                                      one, scale=0.25, sliding_window=window)
                assert torch.equal(out[start + t], ref[0]), (i, t)
        start += n


@pytest.mark.parametrize("path", ["torch", "cpu-kernels-bf16"])
@pytest.mark.parametrize("shapes", [[(300, 600), (700, 1), (0, 530)], [(40, 9), (51, 1)]],
                         ids=["tiles", "short"])
def test_a_sliding_window_column_reads_only_the_blocks_of_its_window(shapes, path):
    """A sliding-window group's table (issue 36): the blocks before the window of each row's
    first query were given back (null entries) and freed blocks hold NaN; the backend passes
    each row from its window's first block on (`window_tail`) and a long prompt chunk is
    attended in tiles of queries: dense attention's result, no NaN."""
    from pagedserve.attention.backends.base import AttentionBatch
    from pagedserve.attention.backends.torch_ref import TorchAttentionBackend
    from pagedserve.platforms import DEFAULT_OPS
    from pagedserve.platforms.base import LayerOps

    # plain torch (SDPA over each piece), or the CPU platform's kernels in bf16 (the prefill
    # kernel over the trimmed context)
    dtype = torch.float32 if path == "torch" else torch.bfloat16
    torch.manual_seed(1)
    window, bs, hq, hkv, d = 37, 4, 4, 2, 8
    num_blocks = 800
    null = num_blocks
    k_cache = torch.full((num_blocks + 1, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[null] = 0
    v_cache[null] = 0
    free = list(range(num_blocks))
    random.Random(2).shuffle(free)
    seqs = []
    for cached, new in shapes:
        total = cached + new
        lo = max(0, cached - window + 1) // bs  # rows given back before this step
        table = [null] * lo + [free.pop() for _ in range(math.ceil(total / bs) - lo)]
        k_all = torch.randn(total, hkv, d).to(dtype)
        v_all = torch.randn(total, hkv, d).to(dtype)
        for p in range(lo * bs, cached):
            k_cache[table[p // bs], p % bs] = k_all[p]
            v_cache[table[p // bs], p % bs] = v_all[p]
        seqs.append((table, total, new, k_all, v_all, torch.randn(new, hq, d).to(dtype)))
    backend = TorchAttentionBackend(LayerOps() if path == "torch" else DEFAULT_OPS)
    meta = backend.build_metadata(AttentionBatch(
        block_tables=[s[0] for s in seqs], seq_lens=[s[1] for s in seqs],
        query_lens=[s[2] for s in seqs], block_size=bs, null_block=null,
        column_windows=(window,)))
    assert max(len(t) for t in meta.block_tables.tolist()) <= math.ceil((window + 600) / bs) + 2
    q = torch.cat([s[5] for s in seqs])
    k = torch.cat([s[3][s[1] - s[2]:] for s in seqs])
    v = torch.cat([s[4][s[1] - s[2]:] for s in seqs])
    out = backend.forward(q, k, v, (k_cache, v_cache), meta, 0.3, window)
    start = 0
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    for table, total, new, k_all, v_all, qs in seqs:
        ref = _dense(qs.float(), k_all.float(), v_all.float(), 0.3, window)
        torch.testing.assert_close(out[start:start + new].float(), ref, atol=tol, rtol=tol)
        start += new


@pytest.mark.parametrize("window", [None, 45])
def test_a_bf16_prompt_row_has_the_same_bits_in_any_chunk_on_the_cpu_kernels(window):
    """Chunked prefill on the CPU platform's prompt kernel (bf16): a prompt attended as one chunk
    or as chunks cut anywhere, each over its cached context (a window's trimmed to the keys its
    queries reach, blocks before it given back and holding NaN), gives every row the same bits.
    The trim starts at an even key, not at the kernel's 32-key tiles: the backend passes the
    trim's position (`key_start`) so that the AMX kernel's tiles stay where they were."""
    from pagedserve.attention.backends.base import AttentionBatch
    from pagedserve.attention.backends.torch_ref import TorchAttentionBackend
    from pagedserve.platforms import DEFAULT_OPS

    torch.manual_seed(3)
    bs, hq, hkv, d, total = 4, 4, 2, 64, 300
    k_all = torch.randn(total, hkv, d).to(torch.bfloat16)
    v_all = torch.randn(total, hkv, d).to(torch.bfloat16)
    q_all = torch.randn(total, hq, d).to(torch.bfloat16)
    backend = TorchAttentionBackend(DEFAULT_OPS)

    def attend(cached, new):  # rows cached .. cached + new - 1 over their context
        nblocks = math.ceil(total / bs)
        null = nblocks
        k_cache = torch.full((nblocks + 1, bs, hkv, d), float("nan"), dtype=torch.bfloat16)
        v_cache = torch.full_like(k_cache, float("nan"))
        k_cache[null] = 0
        v_cache[null] = 0
        lo = max(0, cached - window + 1) // bs if window else 0  # blocks given back
        table = [null] * lo + list(range(lo, math.ceil((cached + new) / bs)))
        for p in range(lo * bs, cached):
            k_cache[p // bs, p % bs] = k_all[p]
            v_cache[p // bs, p % bs] = v_all[p]
        meta = backend.build_metadata(AttentionBatch(
            block_tables=[table], seq_lens=[cached + new], query_lens=[new], block_size=bs,
            null_block=null, column_windows=(window,) if window else (None,)))
        end = cached + new
        return backend.forward(q_all[cached:end], k_all[cached:end], v_all[cached:end],
                               (k_cache, v_cache), meta, 0.3, window)

    whole = attend(0, total)
    for cuts in ([0, 61, 64, 131, 190, total], [0, 7, 100, 102, 233, total]):  # (1-row chunks: decode rows)
        for a, b in zip(cuts, cuts[1:]):
            assert torch.equal(attend(a, b - a), whole[a:b]), (cuts, a, b)
