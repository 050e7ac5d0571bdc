"""layers/gated_delta_net.py: the Gated DeltaNet over a paged state gives every token the same
bits whatever its batch and chunking, and its projections' split equals the fused layout."""

import pytest
import torch

from pagedserve.attention.backends import make_backend
from pagedserve.attention.backends.base import AttentionBatch
from pagedserve.kernels import cpu_fp32
from pagedserve.layers.gated_delta_net import GatedDeltaNet, split_fused_projections
from pagedserve.platforms.cpu import CpuOps

BLOCK, HEADS, DIM, NUM_BLOCKS = 4, 2, 16, 16


def _needs_invariant_kernels():
    """Bit-exactness across batches needs the batch-invariant fp32 kernels (kernels/cpu_fp32.py)."""
    if not cpu_fp32.fp32_kernels_available():
        pytest.skip("fp32 invariant kernels unavailable (disabled, no AVX2/AVX-512, or build failed)")


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(num_k_heads=2, num_v_heads=16, head_k_dim=32, head_v_dim=32, conv_kernel=4, act="silu",
                eps=1e-6, page=2 * HEADS * DIM)
    args.update(kw)
    layer = GatedDeltaNet(64, **args)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    layer.bind(BLOCK, torch.float32)
    return layer


class _Runner:
    """Steps of (sequence, its new rows of `x`), each sequence's state in its own first block."""

    def __init__(self, layer):
        shape = (NUM_BLOCKS + 1, BLOCK, HEADS, DIM)
        self.layer, self.caches = layer, [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                                          for _ in range(layer.num_entries)]
        self.lens: dict[int, int] = {}

    def step(self, batch):
        tables, seq_lens, qlens = [], [], []
        for sid, rows in batch:
            self.lens[sid] = self.lens.get(sid, 0) + len(rows)
            tables.append([sid, NUM_BLOCKS - 1 - sid][: -(-self.lens[sid] // BLOCK)] or [sid])
            seq_lens.append(self.lens[sid])
            qlens.append(len(rows))
        meta = make_backend("torch").build_metadata(AttentionBatch(
            block_tables=tables, seq_lens=seq_lens, query_lens=qlens, block_size=BLOCK,
            null_block=NUM_BLOCKS, device="cpu"))
        with torch.inference_mode():
            out = self.layer(torch.cat([r for _, r in batch]), self.caches, [meta] * self.layer.num_entries)
        return out.split(qlens)


@pytest.mark.parametrize("recurrence", ["kernel", "torch"])
def test_tokens_get_the_same_bits_alone_batched_and_chunked(monkeypatch, recurrence):
    """With the C++ recurrence (kernels/cpu_recurrent.py) and with the layer's torch loop."""
    _needs_invariant_kernels()
    if recurrence == "torch":
        monkeypatch.setattr(CpuOps, "gated_delta_rule_paged", lambda *args: None)
    layer = _layer()
    xs = [torch.randn(n, 64) for n in (7, 3, 5, 6)]
    alone = [torch.cat(_Runner(layer).step([(0, x)])) for x in xs]
    # all four at once, then the same split into chunks and decode steps batched together
    together = _Runner(layer).step([(i, x) for i, x in enumerate(xs)])
    runner, got = _Runner(layer), [[] for _ in xs]
    fed = [0] * len(xs)
    for sizes in ([2, 3, 1, 4], [1, 0, 4, 1], [4, 0, 0, 1]):
        batch = [(i, xs[i][fed[i]:fed[i] + n]) for i, n in enumerate(sizes) if n]
        for (i, rows), out in zip(batch, runner.step(batch)):
            got[i].append(out)
            fed[i] += len(rows)
    if recurrence == "kernel":
        with monkeypatch.context() as m:  # the two paths agree to float32 rounding
            m.setattr(CpuOps, "gated_delta_rule_paged", lambda *args: None)
            loop = _Runner(layer).step([(i, x) for i, x in enumerate(xs)])
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(loop, together))
    for i, x in enumerate(xs):
        assert fed[i] == len(x)
        assert torch.equal(together[i], alone[i]), i
        assert torch.equal(torch.cat(got[i]), alone[i]), i


def test_fused_projections_split_into_the_split_layout():
    hk, hv, dk, dv, h = 2, 4, 3, 5, 7
    r = hv // hk
    q, k = torch.randn(hk, dk, h), torch.randn(hk, dk, h)
    v, z = torch.randn(hk, r * dv, h), torch.randn(hk, r * dv, h)
    b, a = torch.randn(hk, r, h), torch.randn(hk, r, h)
    fused = {"l.linear_attn.in_proj_qkvz.weight": torch.cat([q, k, v, z], 1).reshape(-1, h),
             "l.linear_attn.in_proj_ba.weight": torch.cat([b, a], 1).reshape(-1, h)}
    out = dict(split_fused_projections(fused.items(), num_k_heads=hk, num_v_heads=hv, head_k_dim=dk,
                                       head_v_dim=dv))
    assert torch.equal(out["l.linear_attn.in_proj_qkv.weight"],
                       torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]))
    assert torch.equal(out["l.linear_attn.in_proj_z.weight"], z.reshape(-1, h))
    assert torch.equal(out["l.linear_attn.in_proj_b.weight"], b.reshape(-1, h))
    assert torch.equal(out["l.linear_attn.in_proj_a.weight"], a.reshape(-1, h))
