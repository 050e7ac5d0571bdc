"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator, no
value) as an option of the attention call, on the torch backend."""

import math
import random

import pytest
import torch

from pagedserve.attention.backends.base import AttentionBatch
from pagedserve.attention.backends.torch_ref import TorchAttentionBackend
from pagedserve.kernels.cpu_fp32 import fp32_kernels_available
from pagedserve.layers.attention import PagedAttention
from pagedserve.platforms.base import TORCH_OPS
from pagedserve.platforms.cpu import CPU_OPS

HQ, HKV, D, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 32


def _dense_with_sinks(q, k, v, scale, window, sinks):  # q [L, Hq, D]: the last L of k/v [S, Hkv, D]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    s = k.shape[0]
    qpos = torch.arange(s - q.shape[0], s).unsqueeze(1)
    kpos = torch.arange(s).unsqueeze(0)
    mask = kpos <= qpos
    if window:
        mask &= qpos - kpos < window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(HQ, 1, 1).expand(HQ, q.shape[0], 1)
    p = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]  # as HF's gpt-oss
    return torch.einsum("hqk,khd->qhd", p, v)


class Seqs:
    """Sequences on one paged cache, fed step by step: full K/V/Q drawn up front (head size
    `d`, caches and activations of `dtype`)."""

    def __init__(self, lengths, ops, seed=0, d=D, dtype=torch.float32):
        self.impl = TorchAttentionBackend(ops=ops)
        gen = torch.Generator().manual_seed(seed)
        self.k_cache = torch.full((NUM_BLOCKS + 1, BLOCK, HKV, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.k_cache[NUM_BLOCKS] = 0
        self.v_cache[NUM_BLOCKS] = 0
        free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        self.tables = [[free.pop() for _ in range(math.ceil(n / BLOCK))] for n in lengths]
        self.kvq = [tuple(t.to(dtype) for t in (torch.randn(n, HKV, d, generator=gen),
                                                 torch.randn(n, HKV, d, generator=gen),
                                                 torch.randn(n, HQ, d, generator=gen)))
                    for n in lengths]
        self.d = d
        self.done = [0] * len(lengths)

    def step(self, attn, counts, sinks):
        """Feed `counts[i]` more tokens of sequence i (0: not in the step); the outputs."""
        rows = [i for i, c in enumerate(counts) if c]
        q, k, v = ([self.kvq[i][j][self.done[i]:self.done[i] + counts[i]] for i in rows] for j in (2, 0, 1))
        meta = self.impl.build_metadata(AttentionBatch(
            block_tables=[self.tables[i] for i in rows],
            seq_lens=[self.done[i] + counts[i] for i in rows],
            query_lens=[counts[i] for i in rows], block_size=BLOCK, null_block=NUM_BLOCKS))
        out = attn(torch.cat(q), torch.cat(k), torch.cat(v), (self.k_cache, self.v_cache), meta,
                   sinks=sinks).view(-1, HQ, self.d)
        for i in rows:
            self.done[i] += counts[i]
        return list(out.split([counts[i] for i in rows]))

    def run(self, attn, schedule, sinks):
        """Feed the steps of `schedule` (counts per sequence); each sequence's outputs joined."""
        outs = [[] for _ in self.kvq]
        for counts in schedule:
            for i, o in zip([i for i, c in enumerate(counts) if c], self.step(attn, counts, sinks)):
                outs[i].append(o)
        return [torch.cat(o) for o in outs]

    def run_token_by_token(self, attn, sinks):
        """Every token alone: decode rows only, all sequences side by side until each is done."""
        lengths = [len(k) for k, _, _ in self.kvq]
        return self.run(attn, ([1 if t < n else 0 for n in lengths] for t in range(max(lengths))), sinks)


# mixed prompt chunks and decode rows in the same steps, for sequences of 11, 6 and 9 tokens
MIXED = ([7, 1, 3], [1, 2, 4], [3, 1, 1], [0, 1, 1], [0, 1, 0])


@pytest.mark.parametrize("ops", ["cpu", "torch"])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_dense_attention_and_do_not_depend_on_chunking(window, ops):
    """On the float32 kernel (the CPU platform's ops) and on the torch path (plain ops)."""
    if ops == "cpu" and not fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable")
    ops = CPU_OPS if ops == "cpu" else TORCH_OPS
    attn = PagedAttention(HQ, HKV, D, scale=0.4, sliding_window=window)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    lengths = [11, 6, 9]
    # one run: mixed prompt chunks and decode rows in the same steps
    a = Seqs(lengths, ops)
    outs_a = a.run(attn, MIXED, sinks)
    assert a.done == lengths
    for i, (k, v, q) in enumerate(a.kvq):
        ref = _dense_with_sinks(q, k, v, 0.4, window, sinks)
        torch.testing.assert_close(outs_a[i], ref, atol=1e-5, rtol=1e-5)
    # every token alone (decode rows only): the same bits, token for token
    for x, y in zip(outs_a, Seqs(lengths, ops).run_token_by_token(attn, sinks)):
        assert torch.equal(x, y)
    # sinks change the result (they take weight from the keys)
    c = Seqs(lengths, ops)
    plain = c.step(attn, [lengths[0], 0, 0], None)[0]
    assert not torch.allclose(plain, outs_a[0])


@pytest.mark.parametrize("window", [None, 5])
def test_bf16_sinks_run_on_the_decode_kernel_for_prompt_and_decode_tokens_alike(window, monkeypatch):
    """bf16 caches on the CPU platform: every token (prompt chunk or decode row) is one decode
    row of the compiled decode kernel with the sinks (never `_attend_one`'s torch loop): close
    to the dense formula, and the same bits whether its sequence came in chunks or token by
    token."""
    from pagedserve.attention.backends import torch_ref
    from pagedserve.kernels.cpu_gemm import kernel_available

    if not kernel_available():
        pytest.skip("compiled CPU kernels unavailable")

    def no_torch_loop(*args, **kwargs):
        raise AssertionError("the torch loop ran")

    monkeypatch.setattr(torch_ref, "_attend_one", no_torch_loop)
    d = 16  # the kernel's head sizes are multiples of 16
    attn = PagedAttention(HQ, HKV, d, scale=0.4, sliding_window=window)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    lengths = [11, 6, 9]
    a = Seqs(lengths, CPU_OPS, d=d, dtype=torch.bfloat16)
    outs_a = a.run(attn, MIXED, sinks)
    for i, (k, v, q) in enumerate(a.kvq):
        ref = _dense_with_sinks(q.float(), k.float(), v.float(), 0.4, window, sinks)
        torch.testing.assert_close(outs_a[i].float(), ref, atol=2e-2, rtol=2e-2)
    b = Seqs(lengths, CPU_OPS, d=d, dtype=torch.bfloat16)
    for x, y in zip(outs_a, b.run_token_by_token(attn, sinks)):
        assert torch.equal(x, y)
