"""Random sampling on CPU (kernels.cpu_sampling, csrc/sampling.cpp) against an exact float64
reference of the rule (temperature, top-k with ties, top-p, min-p, inverse CDF in vocabulary
order) and against the sampler's torch path drawing the same uniform."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import cpu_gemm, cpu_sampling
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampler import _sample_row
from pagedserve.kernels.extension import kernels_disabled


@pytest.fixture(scope="module")
def kernel():
    if kernels_disabled() or not cpu_gemm.sampling_kernel_available():
        pytest.skip("sampling kernels unavailable here (no AVX-512, no compiler, or disabled)")


def _kept_weights(row: list[float], t: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """token -> unnormalised probability after the filters, in float64 (the reference)."""
    x = [v / t if not math.isnan(v) else -math.inf for v in row]
    mx = max(x)
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    order = [i for i in order if x[i] > -math.inf]
    if top_k and top_k < len(order):
        kth = x[order[top_k - 1]]
        order = [i for i in order if x[i] >= kth]
    w = {i: math.exp(x[i] - mx) for i in order}
    z = sum(w.values()) if top_k else sum(math.exp(v - mx) for v in x if v > -math.inf)
    kept, cum = [], 0.0
    for n, i in enumerate(order):
        if top_p < 1.0 and n > 0 and cum / z >= top_p:
            break
        if min_p > 0.0 and w[i] < min_p:
            break
        kept.append(i)
        cum += w[i]
    return {i: w[i] for i in sorted(kept)}


def _draw(kept: dict[int, float], u: float) -> tuple[int, float]:
    """The reference token for `u`, and how far u is from the nearest boundary (in u units)."""
    total = sum(kept.values())
    run, margin = 0.0, 1.0
    for i, wi in kept.items():
        run += wi
        margin = min(margin, abs(run / total - u))
        if run > u * total:
            return i, margin
    return i, margin


CASES = [
    dict(t=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(t=0.7, top_k=0, top_p=0.9, min_p=0.0),
    dict(t=1.3, top_k=5, top_p=1.0, min_p=0.0),
    dict(t=1.0, top_k=7, top_p=0.8, min_p=0.0),
    dict(t=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(t=0.5, top_k=20, top_p=0.95, min_p=0.02),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("vocab", [11, 3000])
def test_kernel_draws_the_reference_token_for_each_uniform(kernel, case, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=g) * 4
    logits[:, 3] = logits[:, 5]  # a tie, in reach of top-k
    logits[1, 0] = float("nan")
    logits[2, ::2] = float("-inf")
    us = torch.rand(8, 50, generator=g)
    checked = 0
    for j in range(us.shape[1]):
        u = us[:, j].tolist()
        got = cpu_sampling.sample_rows(logits, [case["t"]] * 8, [case["top_k"]] * 8,
                                       [case["top_p"]] * 8, [case["min_p"]] * 8, u).tolist()
        for r in range(8):
            kept = _kept_weights(logits[r].tolist(), **case)
            assert got[r] in kept, f"row {r}: token {got[r]} is outside the kept set"
            ref, margin = _draw(kept, u[r])
            if margin > 1e-4:  # away from a boundary fp32 and float64 must agree
                assert got[r] == ref, f"row {r}, u={u[r]}"
                checked += 1
    assert checked > 300


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_kernel_and_torch_path_agree_on_the_same_uniform(kernel, case):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5000, generator=g) * 3
    params = SamplingParams(temperature=case["t"], top_k=case["top_k"], top_p=case["top_p"],
                            min_p=case["min_p"])
    same = total = 0
    for _ in range(40):
        u = torch.rand(4, generator=g).tolist()
        got = cpu_sampling.sample_rows(logits, [case["t"]] * 4, [case["top_k"]] * 4,
                                       [case["top_p"]] * 4, [case["min_p"]] * 4, u).tolist()
        ref = [_sample_row(logits[r], params, u[r]) for r in range(4)]
        same += sum(a == b for a, b in zip(got, ref))
        total += 4
    assert same >= total - 2  # only fp32 summation order near a boundary may differ


def test_rows_without_weight_and_nan_logits(kernel):
    logits = torch.full((3, 100), float("-inf"))
    logits[1, 7] = float("nan")
    logits[2, 40] = 1.0
    logits[2, 41] = float("nan")
    for top_p in (1.0, 0.5):
        got = cpu_sampling.sample_rows(logits, [1.0] * 3, [0] * 3, [top_p] * 3, [0.0] * 3,
                                       [0.999, 0.5, 0.999]).tolist()
        assert got == [0, 0, 40]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_plus_infinite_logit_is_always_drawn_on_both_paths(kernel, top_p):
    logits = torch.randn(2, 300)
    logits[0, 17] = logits[0, 40] = float("inf")
    logits[1, 250] = float("inf")
    params = SamplingParams(temperature=0.7, top_p=top_p)
    for u in (0.0, 0.5, 0.999):
        got = cpu_sampling.sample_rows(logits, [0.7] * 2, [0] * 2, [top_p] * 2, [0.0] * 2,
                                       [u] * 2).tolist()
        assert got == [17, 250]
        assert [_sample_row(logits[r], params, u) for r in range(2)] == [17, 250]


def test_a_flat_vocabulary_with_top_p_widens_to_every_token(kernel):
    # Equal logits: the nucleus of 0.999 holds all but a few tokens; candidates start narrow.
    logits = torch.zeros(1, 70000)
    kept = {}
    for u in (0.0, 0.25, 0.5, 0.99):
        [tok] = cpu_sampling.sample_rows(logits, [1.0], [0], [0.999], [0.0], [u]).tolist()
        kept[u] = tok
    assert kept[0.0] == 0 and 17000 <= kept[0.25] <= 18000 and kept[0.99] < 70000


def test_declines_what_it_does_not_take(kernel):
    assert cpu_sampling.sample_rows(torch.zeros(2, 5, dtype=torch.bfloat16), [1.0] * 2, [0] * 2,
                                    [1.0] * 2, [0.0] * 2, [0.5] * 2) is None
    assert cpu_sampling.sample_rows(torch.zeros(2, 0), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2,
                                    [0.5] * 2) is None


def test_top_k_keeps_every_token_tied_with_the_kth(kernel):
    # top_k=3 over [5, 4, 3, 3, 3, 1, ...]: the three 3s are all kept (as `logits < kth -> -inf`).
    row = torch.tensor([[1.0, 3.0, 0.0, 3.0, 5.0, 3.0, 4.0] + [-2.0] * 500])
    kept = _kept_weights(row[0].tolist(), 1.0, 3, 1.0, 0.0)
    assert sorted(kept) == [1, 3, 4, 5, 6]
    drawn = set()
    for u in torch.linspace(0, 0.9999, 200).tolist():
        [tok] = cpu_sampling.sample_rows(row, [1.0], [3], [1.0], [0.0], [u]).tolist()
        ref, margin = _draw(kept, u)
        assert tok == ref or margin < 1e-4
        drawn.add(tok)
    assert drawn == set(kept)


@pytest.mark.parametrize("k,vocab", [(k, v) for v in (7, 3000, 262144) for k in (0, 1, 5, 20)
                                     if k <= v])
def test_logprob_rows_equal_log_softmax_rank_and_topk(kernel, k, vocab):
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(5, vocab, generator=g) * 3
    logits[1, : vocab // 2] = float("-inf")
    logits[2, 0] = logits[2, vocab - 1] = 50.0  # a tie at the top: the lower index first
    targets = torch.randint(0, vocab, (5,), generator=g).tolist()
    targets[1] = vocab - 1
    got = cpu_sampling.logprob_rows(logits, targets, k)
    lp = torch.log_softmax(logits, dim=-1)
    for r, (t_lp, rank, top) in enumerate(got):
        assert abs(t_lp - float(lp[r, targets[r]])) < 1e-4
        assert rank == int((logits[r] > logits[r, targets[r]]).sum()) + 1
        assert len(top) == k
        if k:
            vals, idx = torch.topk(lp[r], k)
            assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
            assert [i for i, _ in top] == idx.tolist() or r == 2  # torch orders ties freely
    if k >= 2 and vocab > 2:
        assert [i for i, _ in got[2][2][:2]] == [0, vocab - 1]


def test_logprob_rows_with_fewer_finite_values_than_k(kernel):
    logits = torch.full((1, 50), float("-inf"))
    logits[0, 7], logits[0, 9] = 1.0, 2.0
    [(lp, rank, top)] = cpu_sampling.logprob_rows(logits, [7], 4)
    assert rank == 2 and lp == pytest.approx(1.0 - math.log(math.e + math.e ** 2), abs=1e-5)
    assert [i for i, _ in top[:2]] == [9, 7] and [v for _, v in top[2:]] == [float("-inf")] * 2
