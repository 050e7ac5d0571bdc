"""Verification of draft tokens (worker/spec_verify.py): rejection sampling leaves every emitted
token distributed exactly as the target's distribution (a chi-square test on a small vocabulary
over many seeds), for point-mass drafts (n-gram) and for a draft distribution q (a draft model);
greedy rows accept exactly the drafts that equal the argmax."""

import pytest
import torch
from scipy.stats import chisquare

from pagedserve.core.step_input import SampleSpec, StepRow
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.spec_verify import accept_greedy, target_probs, verify_row

V = 6


def row(drafts, **params):
    return StepRow(request_id="r", seq_id=0, token_ids=[1, 2, 3], num_prompt_tokens=3, start=2,
                   end=3 + len(drafts), block_table=[0], params=SamplingParams(**params),
                   do_sample=True, samples=[SampleSpec(0, 0, [1, 2, 3], 3)],
                   spec_token_ids=list(drafts))


def emitted(logits, drafts, params, seeds, draft_probs=None):
    """The tokens each seed's verification emits; with `draft_probs` the drafts are drawn from
    them (as a draft model's are), else they are `drafts` (point masses)."""
    out = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        if draft_probs is not None:
            drafts = [int(torch.multinomial(q, 1, generator=gen)) for q in draft_probs]
        r = row(drafts, **params)
        out.append([s.token_id for s in verify_row(logits, r, gen, [], draft_probs)])
    return out


def check_distribution(tokens, probs):
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    probs = probs.double()
    expected = probs / probs.sum() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    _, p_value = chisquare(counts[keep].numpy(), expected[keep].numpy())
    assert p_value > 1e-3, (counts.tolist(), expected.tolist())


@pytest.mark.parametrize("draft", ["point mass", "distribution"])
def test_every_emitted_token_follows_the_target_distribution(draft):
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5  # positions 0, 1, 2 (two drafts)
    drafts = [int(logits[0].argsort(descending=True)[1]), 2]  # the second likeliest, then 2
    params = dict(temperature=0.8, top_k=5)
    q = None
    if draft == "distribution":
        q = torch.softmax(torch.randn(2, V), dim=-1)
    p = [target_probs(logits[j], SamplingParams(**params)) for j in range(3)]
    out = emitted(logits, drafts, params, range(6000), q)
    check_distribution([t[0] for t in out], p[0])
    # Given the first draft accepted, the second emitted token follows position 1's p.
    second = [t[1] for t in out if len(t) > 1]
    assert len(second) > 300
    check_distribution(second, p[1])
    check_distribution([t[2] for t in out if len(t) > 2], p[2])  # the bonus token


def test_the_test_sees_a_biased_verifier():
    # The same check must fail for a verifier that accepts every draft (it would be wrong).
    torch.manual_seed(0)
    logits = torch.randn(2, V) * 1.5
    biased = [int(logits[0].argmin())] * 6000
    with pytest.raises(AssertionError):
        check_distribution(biased, target_probs(logits[0], SamplingParams(temperature=0.8)))


def test_greedy_rows_accept_the_drafts_equal_to_the_argmax_and_then_one_token():
    logits = torch.full((4, V), -1.0)
    for j, t in enumerate([4, 1, 3, 5]):
        logits[j, t] = 1.0
    out = verify_row(logits, row([4, 1, 0], temperature=0.0, logprobs=1), None, [])
    assert [s.token_id for s in out] == [4, 1, 3]
    lp = torch.log_softmax(logits, -1)
    assert [s.logprob for s in out] == pytest.approx([float(lp[0, 4]), float(lp[1, 1]),
                                                      float(lp[2, 3])], abs=1e-6)
    assert accept_greedy([4, 1, 3, 5], [4, 1, 3]) == 4  # all accepted: the bonus too
    assert accept_greedy([2, 1], [4]) == 1
