"""Speculative decoding, the worker's side: verification of a row's draft tokens against the
target model's distribution at each of its positions (rejection sampling, as in Leviathan et al.
2023 / Chen et al. 2023), which leaves the distribution of the output tokens exactly the target's.

A row verifying d drafts has d + 1 logits rows: position j (0 .. d) predicts the token after the
sequence's tokens plus drafts 1 .. j. Each position is processed as the sampler would process a
plain decode row whose output so far ends with those drafts (penalties, bias, min_tokens see them),
so that:

- greedy rows accept draft j while it equals position j's argmax; the first position whose argmax
  differs gives the next token (the argmax), and when all drafts are accepted the last position
  gives a bonus token. Tokens and logprobs are then exactly those of decoding one token per
  step (the logits of each position are, on the batch-invariant float32 kernels);
- random rows with point-mass drafts (the n-gram proposer's) draw position j's token exactly as a
  decode step would (one uniform of the sequence's stream, the sampler's rule) and accept the
  draft when it is that token: accepted with probability p(t), and a rejection emits a draw from
  p without t, which is rejection sampling with q a point mass, and leaves seeded outputs (and the
  random stream) exactly those of decoding without speculation;
- random rows with a draft distribution q (a draft model) accept draft j with probability
  min(1, p(t) / q(t)) (p: the target's processed distribution at position j); on rejection the
  next token is drawn from the normalized residual max(0, p - q); all accepted: the bonus token
  from p.

Logprobs are the raw log-softmax values of each position's logits, as for any sampled token.
"""

from __future__ import annotations

import torch

from pagedserve.core.step_input import StepRow
from pagedserve.core.step_output import SampleResult
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampler import (
    SampleRequest,
    _apply_processors,
    _has_processors,
    _uniform,
    filtered_probs,
    logprob_stats,
    sample,
)


def position_requests(row: StepRow, generator, masks=None) -> list[SampleRequest]:
    """One sampler request per position of a speculative row (see the module docstring);
    `masks` [d + 1, W]: each position's grammar bitmask (structured outputs), else None."""
    spec = row.samples[0]
    prompt, output = spec.prompt_token_ids, spec.output_token_ids
    drafts = row.spec_token_ids
    return [SampleRequest(params=row.params, prompt_token_ids=prompt,
                          output_token_ids=output + drafts[:j] if j else output,
                          generator=generator, need_logprob=row.need_logprob,
                          token_bitmask=None if masks is None else masks[j])
            for j in range(len(drafts) + 1)]


def accept_greedy(tokens: list[int], drafts: list[int]) -> int:
    """How many positions' tokens a greedy row emits: the accepted drafts, then one more."""
    n = 0
    while n < len(drafts) and tokens[n] == drafts[n]:
        n += 1
    return n + 1


def verify_row(logits: torch.Tensor, row: StepRow, generator, stop_ids: list[int],
               draft_probs: torch.Tensor | None = None, masks=None) -> list[SampleResult]:
    """The tokens a speculative row emits (1 .. d + 1): `logits` [d + 1, V] float32 (raw), one
    row per position; `draft_probs` [d, V] the draft model's distributions (None: the drafts are
    point masses, the n-gram proposer's). `masks` [d + 1, W]: a structured-output row's grammar
    bitmask at each position (the grammar after the drafts before it; point-mass drafts only):
    each position samples as a masked decode step would, so a draft the grammar refuses is never
    accepted."""
    if masks is not None and draft_probs is not None:
        raise ValueError("grammar masks apply to point-mass drafts only")
    reqs = position_requests(row, generator, masks)
    drafts = row.spec_token_ids
    params = row.params
    stops = [stop_ids] * len(reqs)
    if params.temperature < 1e-5:
        results = sample(logits, reqs, stops)
        return results[: accept_greedy([r.token_id for r in results], drafts)]
    if draft_probs is None:
        # Point-mass drafts: draw position j's token as a plain decode step would (one uniform
        # of the row's stream), accept the draft if it is that token. P(accept) = p(t), and a
        # rejection emits a draw from p without t: rejection sampling's output distribution,
        # and the very tokens (and random stream) of decoding without speculation.
        results = []
        for j in range(len(drafts) + 1):
            res = sample(logits[j : j + 1], reqs[j : j + 1], stops[:1])[0]
            results.append(res)
            if j == len(drafts) or res.token_id != drafts[j]:
                break
        return results
    processed = logits
    if any(_has_processors(params, len(r.output_token_ids)) for r in reqs):
        processed = _apply_processors(logits.clone(), reqs, stops)
    chosen: list[int] = []
    for j in range(len(drafts) + 1):
        p = target_probs(processed[j], params)  # [V]
        u = _uniform(generator)
        if j == len(drafts):  # every draft accepted: the bonus token
            chosen.append(draw(p, u))
            break
        t = drafts[j]
        q_t = float(draft_probs[j, t])
        if q_t > 0 and u * q_t < float(p[t]):  # accepted with probability min(1, p(t) / q(t))
            chosen.append(t)
            continue
        residual = (p - draft_probs[j].to(p.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # rounding: nothing left, p itself
            residual = p
        chosen.append(draw(residual, _uniform(generator)))
        break
    want_lp = params.logprobs is not None or row.need_logprob
    if not want_lp:
        return [SampleResult(t, None, None, None) for t in chosen]
    k = params.logprobs
    stats = logprob_stats(logits[: len(chosen)], chosen, k or 0)
    return [SampleResult(t, lp, rank, None if k is None else top[:k])
            for t, (lp, rank, top) in zip(chosen, stats)]


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [V] -> [V]
    """The distribution a random row draws from (`sampler._sample_row`'s rule: temperature,
    top-k, top-p, min-p; NaN logits weigh nothing), normalized to sum 1."""
    x = logits.float() / p.temperature
    x = x.masked_fill(x.isnan(), float("-inf"))
    top = float(x.max())
    if top == float("inf") or top == float("-inf"):  # one token outweighs all / none weighs
        probs = torch.zeros_like(x)
        probs[int(torch.argmax(x)) if top == float("inf") else 0] = 1.0
        return probs
    probs = filtered_probs(x, p)
    return probs / probs.sum()


def draw(probs: torch.Tensor, u: float) -> int:
    """The first token whose cumulative weight exceeds `u` times the total (inverse CDF)."""
    cdf = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if idx >= cdf.shape[0]:  # rounding: the last token with weight
        idx = int(torch.nonzero(probs).max())
    return idx
