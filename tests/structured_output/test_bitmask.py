"""The token bitmask in the sampler: only allowed tokens are drawn (greedy and sampled rows in one
batch, unconstrained rows untouched), logprobs are those of the masked logits (as vLLM's), the
grammar wins over min_tokens, logits past the bitmask's width (vocabulary padding) are never
drawn, and the CPU kernels' path (the fused greedy scan, the in-place mask) chooses the same tokens
with the same logprobs as the torch path, over many seeds, with ties and NaN at masked positions."""

import math

import pytest
import torch

from pagedserve.kernels import cpu_grammar
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutputsParams
from pagedserve.structured_output.bitmask import apply_bitmask
from pagedserve.worker.sampler import SampleRequest, sample

SO = StructuredOutputsParams(regex="a")  # any constraint: the bitmask is what counts here


def bitmask_of(allowed, vocab):
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)  # wraps bit 31 like xgrammar's int32 words


def req(allowed=None, vocab=64, seed=None, **kw):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    so = SO if allowed is not None else None
    return SampleRequest(SamplingParams(structured_outputs=so, **kw), [1], [], gen,
                         token_bitmask=None if allowed is None else bitmask_of(allowed, vocab))


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Each test runs on the CPU kernels (where they build) and on the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_grammar, "available", lambda: False)
    elif not cpu_grammar.available():
        pytest.skip("grammar-mask kernels unavailable here")
    return request.param


def test_apply_bitmask_masks_only_the_given_rows_and_the_padding_past_its_width(path):
    logits = torch.zeros(3, 40)
    bm = torch.stack([bitmask_of([3, 31], 32), bitmask_of([5], 32)])  # covers 32 of 40 tokens
    apply_bitmask(logits, bm, [2, 0])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [3, 31]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[1]).all()


def test_greedy_and_sampled_rows_draw_only_allowed_tokens_over_many_seeds(path):
    torch.manual_seed(0)
    for seed in range(50):
        logits = torch.randn(4, 64) * 5
        allowed = [[7, 40], [1, 2, 63], None, [33]]
        reqs = [req(allowed[0], temperature=0.0), req(allowed[1], seed=seed, temperature=1.0),
                req(None, temperature=0.0), req(allowed[3], seed=seed, temperature=0.7, top_k=3)]
        out = sample(logits, reqs, [[]] * 4)
        assert out[0].token_id == max(allowed[0], key=lambda t: logits[0, t])
        assert out[1].token_id in allowed[1]
        assert out[2].token_id == int(logits[2].argmax())
        assert out[3].token_id == 33


def test_logprobs_of_constrained_rows_are_those_of_the_masked_logits(path):
    # vLLM applies the grammar bitmask to the logits before its sampler computes (raw) logprobs:
    # renormalised over the allowed tokens, the masked ones -inf.
    raw = torch.tensor([[0.0, 3.0, 1.0, 2.0] * 8])
    [r] = sample(raw.clone(), [req([2, 3], vocab=32, temperature=0.0, logprobs=3)], [[]])
    expect = torch.log_softmax(torch.tensor([1.0, 2.0]), -1)  # tokens 2 and 3 only
    assert r.token_id == 3
    assert math.isclose(r.logprob, float(expect[1]), rel_tol=1e-6)
    assert [t for t, _ in r.top_logprobs[:2]] == [3, 2]
    assert math.isclose(r.top_logprobs[1][1], float(expect[0]), rel_tol=1e-6)
    assert r.top_logprobs[2][1] == float("-inf")


def test_the_grammar_wins_when_min_tokens_masks_everything_it_allows(path):
    logits = torch.randn(1, 64)
    # the grammar allows only the stop token 5, which min_tokens masks
    [r] = sample(logits, [req([5], temperature=0.0, min_tokens=3)], [[5]])
    assert r.token_id == 5


def test_a_row_whose_allowed_logits_are_all_minus_inf_gets_its_first_allowed_token(path):
    logits = torch.full((2, 64), float("-inf"))
    logits[:, 0] = 5.0  # masked
    reqs = [req([9, 40], temperature=0.0), req([9, 40], seed=1, temperature=1.0)]
    assert [r.token_id for r in sample(logits, reqs, [[]] * 2)] == [9, 9]


def random_batch(seed: int, vocab: int):
    """Logits with ties, NaN and +inf at masked positions, and requests of every kind: greedy,
    sampled (top-k / top-p / min-p), with logprobs, with processors, unconstrained."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(8, vocab, generator=g) * 3).round()  # many ties
    allowed = [torch.randperm(vocab, generator=g)[: int(n)].tolist()
               for n in torch.randint(1, vocab // 2, (8,), generator=g)]
    for i, ok in enumerate(allowed):
        banned = sorted(set(range(vocab)) - set(ok))[:6]
        logits[i, banned[:2]] = float("nan")
        logits[i, banned[2:4]] = float("inf")
        logits[i, banned[4:]] = 1e4
    reqs = [
        req(allowed[0], vocab, temperature=0.0),
        req(allowed[1], vocab, temperature=0.0),
        req(allowed[2], vocab, temperature=0.0, logprobs=2),
        req(allowed[3], vocab, temperature=0.0, repetition_penalty=1.3),
        req(allowed[4], vocab, seed=seed, temperature=0.8),
        req(allowed[5], vocab, seed=seed, temperature=1.0, top_k=5, top_p=0.9, logprobs=1),
        req(allowed[6], vocab, seed=seed, temperature=1.2, min_p=0.1, logit_bias={1: 5.0}),
        req(None, vocab, temperature=0.0),
    ]
    return logits, allowed, reqs


@pytest.mark.skipif(not cpu_grammar.available(), reason="grammar-mask kernels unavailable here")
@pytest.mark.parametrize("vocab", [96, 1000])
def test_kernel_and_torch_paths_choose_the_same_allowed_tokens_over_many_seeds(vocab, monkeypatch):
    for seed in range(40):
        logits, allowed, reqs = random_batch(seed, vocab)
        fast = sample(logits.clone(), reqs, [[]] * 8)
        with monkeypatch.context() as m:
            m.setattr(cpu_grammar, "available", lambda: False)
            _, _, reqs2 = random_batch(seed, vocab)  # fresh generators
            slow = sample(logits.clone(), reqs2, [[]] * 8)
        assert [r.token_id for r in fast] == [r.token_id for r in slow], seed
        for i in range(7):
            assert fast[i].token_id in allowed[i], (seed, i)
        for a, b in zip(fast, slow):
            assert (a.logprob, a.rank, a.top_logprobs) == (b.logprob, b.rank, b.top_logprobs)
