"""`layers.mamba2`'s batch-invariant pieces: softplus from exp and log, the fixed-order sum."""

import torch
import torch.nn.functional as F

from pagedserve.layers.mamba2 import softplus, tree_sum


def test_softplus_matches_torch_and_ignores_position():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(5000, generator=gen) * 8, torch.tensor([-90.0, -20.0, 0.0, 19.9, 20.5, 80.0])])
    ours = softplus(x)
    assert torch.allclose(ours, F.softplus(x), rtol=1e-6, atol=0)
    # an element's bits do not depend on where it sits in the tensor (torch's tail differs)
    for start in (1, 7, 33):
        assert torch.equal(softplus(x[start:start + 45]), ours[start:start + 45])
    assert torch.equal(torch.stack([softplus(v[None])[0] for v in x[:64]]), ours[:64])


def test_tree_sum_is_a_sum_in_one_order_per_row():
    gen = torch.Generator().manual_seed(1)
    for n in (1, 5, 16, 24):
        x = torch.randn(7, 3, n, generator=gen)
        got = tree_sum(x)
        assert got.shape == (7, 3)
        assert torch.allclose(got, x.sum(-1), atol=1e-5)
        assert torch.equal(tree_sum(x[2:3]), got[2:3])  # a row alone: the same bits
