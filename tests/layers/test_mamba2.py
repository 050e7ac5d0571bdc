"""`layers.mamba2`'s batch-invariant pieces: the fixed-order sum, per-row time steps."""

import torch

from pagedserve.layers.mamba2 import Mamba2Mixer, tree_sum


def test_tree_sum_is_a_sum_in_one_order_per_row():
    gen = torch.Generator().manual_seed(1)
    for n in (1, 5, 16, 24):
        x = torch.randn(7, 3, n, generator=gen)
        got = tree_sum(x)
        assert got.shape == (7, 3)
        assert torch.allclose(got, x.sum(-1), atol=1e-5)
        assert torch.equal(tree_sum(x[2:3]), got[2:3])  # a row alone: the same bits


def test_time_steps_are_a_token_rows_whatever_the_batch():
    """softplus(dt + dt_bias) clamped: HF's formula, one token's row at a time (the same bits
    for a row alone as in any batch)."""
    mixer = Mamba2Mixer(64, num_heads=6, head_dim=16, state_size=8, n_groups=1, conv_kernel=4, page=64,
                        time_step_limit=(0.01, 3.0))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        mixer.dt_bias.copy_(torch.randn(6, generator=gen))
    dt = torch.randn(37, 6, generator=gen) * 4
    got = mixer.time_steps(dt)
    ref = torch.nn.functional.softplus(dt + mixer.dt_bias.detach()).clamp(0.01, 3.0)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)
    assert all(torch.equal(mixer.time_steps(dt[i:i + 1])[0], got[i]) for i in range(37))
