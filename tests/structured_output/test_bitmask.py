"""The token bitmask in the sampler: only allowed tokens are drawn (greedy and sampled rows in one
batch, unconstrained rows untouched), logprobs stay raw, the grammar wins over min_tokens, and
logits past the bitmask's width (vocabulary padding) are never drawn."""

import math

import torch

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


def test_apply_bitmask_masks_only_the_given_rows_and_the_padding_past_its_width():
    logits = torch.zeros(2, 40)
    bm = torch.stack([bitmask_of([3, 31], 32), bitmask_of([5], 32)])  # covers 32 of 40 tokens
    apply_bitmask(logits, bm, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 31]
    assert torch.isfinite(logits[1]).all()


def test_greedy_and_sampled_rows_draw_only_allowed_tokens_over_many_seeds():
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


def test_logprobs_of_constrained_rows_are_the_raw_ones():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0] * 8])
    [r] = sample(logits, [req([2], vocab=32, temperature=0.0, logprobs=1)], [[]])
    assert r.token_id == 2
    assert math.isclose(r.logprob, float(torch.log_softmax(logits[0], -1)[2]), rel_tol=1e-6)


def test_the_grammar_wins_when_min_tokens_masks_everything_it_allows():
    logits = torch.randn(1, 64)
    # the grammar allows only the stop token 5, which min_tokens masks
    [r] = sample(logits, [req([5], temperature=0.0, min_tokens=3)], [[5]])
    assert r.token_id == 5
