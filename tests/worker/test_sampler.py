"""The sampler alone: greedy, filters, penalties, min_tokens, logprobs."""

import math

import pytest
import torch

from pagedserve.kernels import cpu_gemm, cpu_sampling
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampler import SampleRequest, prompt_logprobs, sample
from pagedserve.kernels.extension import kernels_disabled


@pytest.fixture(params=["kernel", "torch"])
def sampling_path(request, monkeypatch):
    """Random rows drawn by the compiled kernel (kernels.cpu_sampling) or by the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_sampling, "sample_rows", lambda *a: None)
    elif kernels_disabled() or not cpu_gemm.sampling_kernel_available():
        pytest.skip("sampling kernels unavailable here (AVX-512 only)")
    return request.param


def req(out=(), prompt=(), seed=None, **kw):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRequest(SamplingParams(**kw), list(prompt), list(out), gen)


def test_greedy_picks_argmax_and_reports_raw_logprob_rank_and_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    [r] = sample(logits, [req(temperature=0.0, logprobs=2)], [[]])
    assert r.token_id == 1 and r.rank == 1
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(r.logprob, float(raw[1]), rel_tol=1e-6)
    assert [t for t, _ in r.top_logprobs] == [1, 3]


def test_logprobs_are_raw_even_with_penalties_and_bias():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    [r] = sample(logits, [req(temperature=0.0, logprobs=0, logit_bias={2: 10.0})], [[]])
    assert r.token_id == 2
    assert math.isclose(r.logprob, float(torch.log_softmax(logits[0], -1)[2]), rel_tol=1e-6)
    assert r.rank == 3


def test_top_k_one_and_tiny_top_p_are_greedy_and_min_p_drops_the_tail(sampling_path):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    for kw in (dict(top_k=1), dict(top_p=0.01)):
        toks = {sample(logits, [req(temperature=1.0, seed=s, **kw)], [[]])[0].token_id
                for s in range(20)}
        assert toks == {1}, kw
    toks = {sample(logits, [req(temperature=1.0, seed=s, min_p=0.5)], [[]])[0].token_id
            for s in range(40)}
    assert toks == {1, 3}


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    [r] = sample(logits, [req(temperature=0.0, min_tokens=2, out=[2])], [[1]])
    assert r.token_id != 1
    [r] = sample(logits, [req(temperature=0.0, min_tokens=2, out=[2, 2])], [[1]])
    assert r.token_id == 1


def test_repetition_frequency_and_presence_penalties_demote_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, [req(temperature=0.0, repetition_penalty=1.5, prompt=[0])],
                  [[]])[0].token_id == 1
    assert sample(logits, [req(temperature=0.0, frequency_penalty=0.2, out=[0])],
                  [[]])[0].token_id == 1
    assert sample(logits, [req(temperature=0.0, presence_penalty=0.2, out=[0])],
                  [[]])[0].token_id == 1
    assert sample(logits, [req(temperature=0.0)], [[]])[0].token_id == 0


def test_seeded_rows_are_reproducible_and_independent_of_neighbours(sampling_path):
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    a = sample(logits, [req(temperature=1.0), req(temperature=1.0, seed=5),
                        req(temperature=1.0)], [[]] * 3)[1].token_id
    b = sample(logits[1:2], [req(temperature=1.0, seed=5)], [[]])[0].token_id
    assert a == b


def test_prompt_logprobs_give_target_logprob_rank_and_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = prompt_logprobs(logits, [2, 0], 1)
    lp = torch.log_softmax(logits, -1)
    assert out[0][1] == 2 and math.isclose(out[0][0], float(lp[0, 2]), rel_tol=1e-6)
    assert out[1][1] == 1 and out[0][2][0][0] == 1


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_sampling_follows_the_distribution(temperature, sampling_path):
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0]
    params = SamplingParams(temperature=temperature)
    for _ in range(2000):
        r = sample(logits, [SampleRequest(params, [], [], gen)], [[]])[0]
        counts[r.token_id] += 1
    p = torch.softmax(logits[0] / temperature, -1)
    for c, expected in zip(counts, p.tolist()):
        assert abs(c / 2000 - expected) < 0.04


@pytest.mark.parametrize("kw,expected", [
    (dict(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0]),  # mass before token 3: 0.9
    (dict(top_k=2), [2 / 3, 1 / 3, 0.0, 0.0]),
    (dict(min_p=0.25), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0]),  # 0.1 < 0.25 * 0.5
])
def test_filters_renormalise_what_they_keep(kw, expected, sampling_path):
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, **kw)
    n = 3000
    counts = [0] * 4
    # a batch of 8 rows a call: the kernel's rows run on several threads
    for _ in range(n // 8):
        rows = sample(logits.expand(8, -1).contiguous(),
                      [SampleRequest(params, [], [], gen) for _ in range(8)], [[]] * 8)
        for r in rows:
            counts[r.token_id] += 1
    total = sum(counts)
    for c, e in zip(counts, expected):
        assert abs(c / total - e) < 0.035 and (c == 0) == (e == 0)


@pytest.mark.parametrize("vocab", [262144, 32000, 151936, 1000, 7])
def test_argmax_rows_is_torch_argmax_including_ties_and_nan(vocab):
    from pagedserve.worker.sampler import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g)
    x[1, :] = 0.0  # every entry ties: the first wins
    x[2, vocab // 3] = x[2, vocab - 1] = 1e9  # a tie between chunks
    x[3, vocab // 2] = float("nan")  # NaN is the maximum
    x[4, -1] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_allowed_token_ids_mask_every_other_token(sampling_path):
    logits = torch.tensor([[5.0, 0.0, 1.0, 4.0, 2.0]] * 3)
    reqs = [req(temperature=0.0, allowed_token_ids=[2, 4]),
            *(req(temperature=1.0, seed=s, allowed_token_ids=[1, 2]) for s in range(2))]
    results = sample(logits, reqs, [[], [], []])
    assert results[0].token_id == 4
    assert all(r.token_id in (1, 2) for r in results[1:])


def test_bad_words_mask_a_words_last_token_after_its_other_tokens():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])
    words = [[4, 2], [3]]  # a two-token word ending in 2, a single token 3 (always banned)
    after_4 = sample(logits, [req(out=[4], temperature=0.0, bad_words_token_ids=words)], [[]])
    after_1 = sample(logits, [req(out=[1], temperature=0.0, bad_words_token_ids=words)], [[]])
    assert after_4[0].token_id == 4  # 2 banned after 4, 3 always: next best is 4
    assert after_1[0].token_id == 2  # 2 allowed elsewhere
    first = sample(logits, [req(temperature=0.0, bad_words_token_ids=[[1, 4, 2]])], [[]])
    assert first[0].token_id == 2  # a word's prefix not yet generated bans nothing
