"""layers.linear.fuse_linears / linear_outputs: projections that read one input (q|k|v, gate|up)
re-homed into one buffer run as one product (the CUDA platform's binding), with the outputs of
separate products and no memory added."""

import pytest
import torch
from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.linear import ColumnParallelLinear, fuse_linears, linear_outputs


def _group(bias=True, sizes=(8, 4, 4), k=16, seed=0):
    torch.manual_seed(seed)
    group = [ColumnParallelLinear(k, n, bias) for n in sizes]
    with torch.no_grad():
        for m in group:
            m.weight.normal_()
            if m.bias is not None:
                m.bias.normal_()
    return group


@pytest.mark.parametrize("bias", [True, False])
def test_fused_group_is_one_product_with_the_separate_outputs(bias, monkeypatch):
    group = _group(bias)
    x = torch.randn(5, 16)
    want = [m(x) for m in group]
    assert fuse_linears(group)
    storage = group[0].weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == storage for m in group)
    calls = []
    ops = group[0].ops
    monkeypatch.setattr(type(ops), "linear", lambda self, x, w, b=None: calls.append(w.shape)
                        or torch.nn.functional.linear(x, w, b))
    got = linear_outputs(x, group)
    assert calls == [(16, 16)]  # one product over the 8 + 4 + 4 rows
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [m(x).shape for m in group] == [(5, 8), (5, 4), (5, 4)]  # each still runs alone


def test_fusing_keeps_the_shard_spec_and_loading_through_the_views():
    tp = TPContext(rank=0, world_size=2)
    group = [ColumnParallelLinear(16, 8, False, tp=tp), ColumnParallelLinear(16, 8, False, tp=tp)]
    specs = [m.weight.shard for m in group]
    assert fuse_linears(group)
    assert [m.weight.shard for m in group] == specs
    with torch.no_grad():  # a load that copies into the parameters keeps the fused buffer
        group[1].weight.copy_(torch.ones(4, 16))
    out = linear_outputs(torch.ones(1, 16), group)
    assert out[1].tolist() == [[16.0] * 4]


def test_fusing_declines_mixed_groups_and_replaced_weights_fall_back():
    a, b = _group(True, sizes=(4, 4))
    b.bias = None
    assert not fuse_linears([a, b])  # one with a bias, one without
    assert not fuse_linears([nn.Linear(16, 4), nn.Linear(16, 4)])  # not ours (e.g. a wrapper)
    assert not fuse_linears(_group(sizes=(4,)))  # nothing to fuse
    group = _group(sizes=(4, 4))
    assert fuse_linears(group)
    group[1].weight = nn.Parameter(torch.zeros(4, 16), requires_grad=False)  # replaced, not copied
    x = torch.randn(2, 16)
    got = linear_outputs(x, group)
    assert torch.equal(got[1], group[1].bias.expand(2, 4))  # the new weight, not the stale buffer
