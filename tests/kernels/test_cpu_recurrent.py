"""kernels/cpu_recurrent.py: the Gated DeltaNet, Kimi Delta Attention and Mamba 2 recurrences in C++ -- equal to the
recurrence in float64 up to float32 rounding, and batch-invariant: a sequence's outputs and
state bits do not depend on the other sequences of the call or on how its tokens are split
into calls."""

import pytest
import torch

from pagedserve.kernels.cpu_fp32 import fp32_kernels_available
from pagedserve.kernels.cpu_recurrent import gated_delta_rule, kimi_delta_rule, ssm_scan

pytestmark = pytest.mark.skipif(not fp32_kernels_available(), reason="no fp32 CPU kernels here")


def _gdr_ref(q, k, v, beta, decay, state):  # one sequence, float64: [T, H, V], [H, K, V]
    s = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        # (KDA: decay [T, H, K], key row i of each head's state times its own)
        s = s * (decay[t].double()[:, :, None] if decay.dim() == 3 else decay[t].double()[:, None, None])
        mem = torch.einsum("hk,hkv->hv", k[t].double(), s)
        delta = (v[t].double() - mem) * beta[t].double()[:, None]
        s = s + k[t].double()[:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t].double(), s))
    return torch.stack(out), s


def _ssm_ref(x, dt, A, B, C, D, state):  # one sequence, float64
    s = state.double().clone()
    h, g = x.shape[1], B.shape[1]
    rep = h // g
    ys = []
    for t in range(x.shape[0]):
        bt, ct = B[t].double().repeat_interleave(rep, 0), C[t].double().repeat_interleave(rep, 0)  # [H, N]
        da = torch.exp(dt[t].double() * A.double())  # [H]
        s = s * da[:, None, None] + (dt[t].double()[:, None] * x[t].double())[:, :, None] * bt[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", s, ct) + D.double()[:, None] * x[t].double())
    return torch.stack(ys), s


def _gdr_inputs(n, h=3, k=8, v=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, h, k, generator=g), dim=-1)
    kk = torch.nn.functional.normalize(torch.randn(n, h, k, generator=g), dim=-1)
    return (q, kk, torch.randn(n, h, v, generator=g), torch.rand(n, h, generator=g),
            torch.rand(n, h, generator=g) * 0.5 + 0.5)


def _kda_inputs(n, h=3, k=8, v=16, seed=0):
    q, kk, vv, beta, _ = _gdr_inputs(n, h, k, v, seed)
    g = torch.Generator().manual_seed(seed + 100)
    return q, kk, vv, beta, torch.rand(n, h, k, generator=g) * 0.6 + 0.4  # a decay per key channel


def _ssm_inputs(n, h=4, p=8, g_=2, nst=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, p, generator=g), torch.rand(n, h, generator=g) * 0.5,
            -torch.rand(h, generator=g) - 0.1, torch.randn(n, g_, nst, generator=g),
            torch.randn(n, g_, nst, generator=g), torch.randn(h, generator=g))


def _qsl(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)


def test_gated_delta_rule_equals_the_recurrence():
    ins = _gdr_inputs(7)
    state = torch.randn(1, 3, 8, 16)
    ref_out, ref_state = _gdr_ref(*ins, state[0])
    out = gated_delta_rule(*ins, state, _qsl([7]))
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0].double(), ref_state, rtol=1e-5, atol=1e-5)


def test_kimi_delta_rule_equals_the_recurrence_with_a_decay_per_key_channel():
    ins = _kda_inputs(7)
    state = torch.randn(1, 3, 8, 16)
    init = state[0].clone()
    ref_out, ref_state = _gdr_ref(*ins, init)
    out = kimi_delta_rule(*ins, state, _qsl([7]))
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0].double(), ref_state, rtol=1e-5, atol=1e-5)
    # the channels' decays differ: one decay a head (their mean) is another recurrence
    _, mean_state = _gdr_ref(*ins[:4], ins[4].mean(-1), init)
    assert not torch.allclose(mean_state, ref_state, atol=1e-3)
    with pytest.raises(ValueError, match="decay"):
        kimi_delta_rule(*ins[:4], ins[4][:, :, :4].contiguous(), torch.zeros(1, 3, 8, 16), _qsl([7]))


def test_ssm_scan_equals_the_recurrence():
    ins = _ssm_inputs(6)
    state = torch.randn(1, 4, 8, 16)
    ref_y, ref_state = _ssm_ref(*ins, state[0])
    y = ssm_scan(*ins, state, _qsl([6]))
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0].double(), ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gdr", "kda", "ssm"])
def test_a_sequence_gets_the_same_bits_alone_batched_or_token_by_token(kind):
    # sequence 0 (9 tokens) alone; then beside two others (5 and 1 tokens); then in 3 + 1 + 5 calls
    make = {"gdr": _gdr_inputs, "kda": _kda_inputs, "ssm": _ssm_inputs}[kind]
    run = {"gdr": gated_delta_rule, "kda": kimi_delta_rule, "ssm": ssm_scan}[kind]
    state_shape = (4, 8, 16) if kind == "ssm" else (3, 8, 16)
    kind = "gdr" if kind == "kda" else kind  # (every input per token)
    mine, other = make(9, seed=1), make(6, seed=2)
    init = torch.randn(1, *state_shape, generator=torch.Generator().manual_seed(3))

    def cut(ins, a, b):  # the inputs of tokens a..b (Mamba's A and D are per head)
        return [t[a:b] if i < len(ins) and (kind == "gdr" or i not in (2, 5)) else t
                for i, t in enumerate(ins)]

    alone_state = init.clone()
    alone = run(*mine, alone_state, _qsl([9]))
    both = [torch.cat([m, o[:6]]) if (kind == "gdr" or i not in (2, 5)) else m
            for i, (m, o) in enumerate(zip(mine, other))]
    batched_state = torch.cat([init, torch.randn(2, *state_shape)])
    batched = run(*both, batched_state, _qsl([9, 5, 1]))
    assert torch.equal(batched[:9], alone) and torch.equal(batched_state[0], alone_state[0])
    split_state, parts = init.clone(), []
    for a, b in ((0, 3), (3, 4), (4, 9)):
        parts.append(run(*cut(mine, a, b), split_state, _qsl([b - a])))
    assert torch.equal(torch.cat(parts), alone) and torch.equal(split_state, alone_state)
