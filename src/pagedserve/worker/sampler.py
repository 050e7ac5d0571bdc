"""Batched sampling: logit processors, greedy / random choice, and logprobs.

Logprobs are always the raw log-softmax of the model's logits (before penalties, bias and
temperature), as vLLM reports them; for a structured-output row, of its logits after the grammar's
token bitmask (as vLLM's, which masks the logits before its sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_grammar, cpu_sampling
from pagedserve.core.step_output import SampleResult
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.bitmask import apply_bitmask, first_allowed, is_allowed


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # The chosen token's logprob is needed even without `logprobs` (best_of ranks by it).
    need_logprob: bool = False
    # Structured outputs: the int32 bitmask [ceil(V / 32)] of the tokens the grammar allows.
    token_bitmask: torch.Tensor | None = None


def _apply_processors(
    logits: torch.Tensor, reqs: list[SampleRequest], stop_ids: list[list[int]]
) -> torch.Tensor:
    """Penalties, logit bias and min_tokens masking, row by row where a row asks for them."""
    vocab = logits.shape[-1]
    for i, req in enumerate(reqs):
        p = req.params
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
            vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if 0 <= t < vocab])
            row.index_add_(0, ids, vals.to(row.dtype))
        if p.min_tokens and len(req.output_token_ids) < p.min_tokens and stop_ids[i]:
            row[torch.tensor(stop_ids[i], dtype=torch.long)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)),
                                dtype=torch.long)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long),
                                    minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.allowed_token_ids is not None or p.bad_words_token_ids:
            _mask_tokens(row, p, req.output_token_ids)
    return logits


def _mask_tokens(row: torch.Tensor, p: SamplingParams, output: list[int]) -> None:
    """`allowed_token_ids` (everything else to -inf) and `bad_words_token_ids` (a word's last
    token to -inf when the output ends with the word's other tokens), as vLLM's processors."""
    vocab = row.shape[-1]
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        keep[torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long,
                          device=row.device)] = True
        row.masked_fill_(~keep, float("-inf"))
    banned = [w[-1] for w in p.bad_words_token_ids or ()
              if w[-1] < vocab and (len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1])]
    if banned:
        row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")


def _grammar_wins(logits: torch.Tensor, processed: torch.Tensor, rows: list[int]) -> None:
    """NOTE: the grammar wins: a constrained row the processors (min_tokens, bias, ...) left with
    no allowed token goes back to its grammar-masked logits (`logits`, already masked), so the
    token drawn is always one the grammar allows."""
    if not rows:
        return
    top = processed[rows].amax(dim=-1).tolist()
    dead = [i for i, t in zip(rows, top) if t == float("-inf")]
    if dead:
        processed[dead] = logits[dead]


def _enforce_grammar(tokens: list[int], reqs: list[SampleRequest], rows: list[int]) -> None:
    """NOTE: a constrained row whose allowed tokens all have no weight (every allowed logit -inf)
    would get token 0 from argmax / the draw, which its grammar may forbid: it gets its first
    allowed token instead (what `cpu_grammar.masked_argmax` returns for such a row)."""
    for i in rows:
        mask = reqs[i].token_bitmask
        if not is_allowed(mask, tokens[i]):
            first = first_allowed(mask)
            if first is not None:
                tokens[i] = first


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S] int64
    """`x.argmax(dim=-1)` (same result: the first maximum; NaN counts as the maximum), faster on
    CPU for large vocabularies: the maximum of each chunk of 512 (or 256, 128, 64) logits first
    (a vectorised reduction), then the argmax inside the one chunk that holds it. torch's CPU
    argmax over a 262,144-token row runs at a fraction of memory bandwidth."""
    s, v = x.shape
    for c in (512, 256, 128, 64):
        if v % c == 0 and v >= 8 * c:
            break
    else:
        return x.argmax(dim=-1)
    blocks = x.reshape(s, v // c, c)  # [S, V/c, c]
    # NOTE: the first chunk holding the maximum, then the first maximum inside it: the first
    # maximum overall, as argmax (a NaN is a chunk's amax and the argmax of its chunk).
    chunk = blocks.amax(dim=-1).argmax(dim=-1)  # [S]
    inner = blocks[torch.arange(s, device=x.device), chunk].argmax(dim=-1)  # [S]
    return chunk * c + inner


def needs_processing(p: SamplingParams, n_out: int) -> bool:
    """Whether a row with `n_out` output tokens so far has logit processors to apply (bias,
    min_tokens masking, penalties, a structured-output grammar)."""
    return _has_processors(p, n_out) or p.structured_outputs is not None


def _has_processors(p: SamplingParams, n_out: int) -> bool:
    return bool(
        p.logit_bias
        or (p.min_tokens and n_out < p.min_tokens)
        or p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
        or p.allowed_token_ids is not None
        or p.bad_words_token_ids
    )


def _uniform(generator: torch.Generator | None) -> float:
    """One draw in [0, 1) from the request's generator (the global one when None)."""
    return float(torch.rand((), generator=generator))


def filtered_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [V] -> [V]
    """Probabilities of tempered logits `x` (finite maximum, NaN already -inf) after top-k (ties
    with the k-th kept), top-p (the smallest prefix by probability, ties by index, whose mass
    reaches top_p) and min-p, not renormalized: the rule `_sample_row` draws from and the
    speculative verifier's target distribution (worker/spec_verify.py)."""
    if p.top_k and 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [V]
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cum - sorted_probs) >= p.top_p
        probs = probs.clone()
        probs[order[drop_sorted]] = 0.0
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _sample_row(logits: torch.Tensor, p: SamplingParams, u: float) -> int:  # logits [V]
    """The torch path of `_sample_random` (csrc/sampling.cpp follows the same rule): temperature,
    top-k (ties with the k-th kept), top-p (the smallest prefix by probability, ties by index,
    whose mass reaches top_p), min-p; then the first token whose cumulative probability exceeds
    `u` times the kept mass. NaN logits have probability 0."""
    x = logits / p.temperature
    x = x.masked_fill(x.isnan(), float("-inf"))
    top = float(x.max())
    if top == float("inf"):  # +inf outweighs everything: the first +inf
        return int(torch.argmax(x))
    if top == float("-inf"):
        return 0  # nothing has weight
    probs = filtered_probs(x, p)  # [V]
    cdf = torch.cumsum(probs, dim=-1)  # [V]
    idx = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if idx >= cdf.shape[0]:  # rounding: the last token with weight
        idx = int(torch.nonzero(probs).max())
    return idx


def _sample_random(logits: torch.Tensor, reqs: list[SampleRequest]) -> list[int]:  # logits [R, V]
    """One token per row, drawn with the row's own generator: on the compiled kernel
    (`kernels.cpu_sampling`, no vocabulary sort) where it applies, else row by row in torch. Each
    row consumes one uniform draw of its generator, so seeded requests are reproducible whatever
    else is in the batch."""
    u = [_uniform(r.generator) for r in reqs]
    params = [r.params for r in reqs]
    tokens = cpu_sampling.sample_rows(
        logits, [p.temperature for p in params], [max(p.top_k or 0, 0) for p in params],
        [p.top_p for p in params], [p.min_p for p in params], u)
    if tokens is not None:
        return tokens.tolist()
    return [_sample_row(logits[i], p, u[i]) for i, p in enumerate(params)]


def sample(
    logits: torch.Tensor,  # [S, V] float32
    reqs: list[SampleRequest],
    stop_ids: list[list[int]],
) -> list[SampleResult]:
    """Choose one token per row. `stop_ids[i]`: EOS / stop token ids masked while a row is below
    its `min_tokens`.

    NOTE: structured outputs mask `logits` in place (the rows of constrained requests), as vLLM
    applies the grammar bitmask to the logits before its sampler: the logprobs of a constrained
    row are those of its masked logits (renormalised over the tokens the grammar allows). A greedy
    constrained row that needs nothing else (no logprobs, no processors) is not written: its token
    comes from one fused scan of the logits and the mask (`kernels.cpu_grammar.masked_argmax`)."""
    num_rows = logits.shape[0]
    want_lp = [r.params.logprobs is not None or r.need_logprob for r in reqs]
    processors = [_has_processors(r.params, len(r.output_token_ids)) for r in reqs]
    greedy = [r.params.temperature < 1e-5 for r in reqs]
    grammar = [i for i, r in enumerate(reqs) if r.token_bitmask is not None]
    fused, fused_tokens = [], []
    if grammar:
        fused = [i for i in grammar if greedy[i] and not want_lp[i] and not processors[i]]
        if fused:
            masks = torch.stack([reqs[i].token_bitmask for i in fused])
            out = cpu_grammar.masked_argmax(logits, masks, fused)
            fused, fused_tokens = ([], []) if out is None else (fused, out.tolist())
        in_place = [i for i in grammar if i not in fused]
        if in_place:
            apply_bitmask(logits, torch.stack([reqs[i].token_bitmask for i in in_place]),
                          in_place)
    processed = logits
    if any(processors):
        processed = _apply_processors(logits.clone(), reqs, stop_ids)
        _grammar_wins(logits, processed, [i for i in grammar if processors[i]])

    fused_set = set(fused)
    greedy_rows = [i for i in range(num_rows) if greedy[i] and i not in fused_set]
    random_rows = [i for i in range(num_rows) if not greedy[i]]
    tokens = [0] * num_rows
    for i, tok in zip(fused, fused_tokens):
        tokens[i] = tok
    if greedy_rows:  # fast path: no sort, no softmax
        picked = processed if len(greedy_rows) == num_rows else processed[greedy_rows]
        for i, tok in zip(greedy_rows, argmax_rows(picked).tolist()):
            tokens[i] = tok
    if random_rows:
        picked = processed if len(random_rows) == num_rows else processed[random_rows]
        for i, tok in zip(random_rows, _sample_random(picked, [reqs[i] for i in random_rows])):
            tokens[i] = tok
    if grammar:
        _enforce_grammar(tokens, reqs, [i for i in grammar if i not in fused_set])

    # Raw logprobs (of the logits before processors; grammar-masked) of the chosen tokens.
    lp_rows = [i for i in range(num_rows) if want_lp[i]]
    stats = {}
    if lp_rows:
        k = max(reqs[i].params.logprobs or 0 for i in lp_rows)
        picked = logits if len(lp_rows) == num_rows else logits[lp_rows]
        stats = dict(zip(lp_rows, logprob_stats(picked, [tokens[i] for i in lp_rows], k)))
    results = []
    for i in range(num_rows):
        if i not in stats:
            # NOTE: as in vLLM, no logprob (and no cumulative logprob) unless the request asks:
            # a log-softmax over a 262k vocabulary per row per step is not free.
            results.append(SampleResult(tokens[i], None, None, None))
            continue
        lp, rank, top = stats[i]
        k = reqs[i].params.logprobs
        results.append(SampleResult(tokens[i], lp, rank, None if k is None else top[:k]))
    return results


def logprob_stats(
    logits: torch.Tensor,  # [P, V] float32
    targets: list[int],  # [P]
    k: int,
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per row: the raw logprob of its target token, the target's rank (1 + the number of tokens
    more likely) and the row's top-k (token, logprob), best first. On the compiled kernel
    (`kernels.cpu_sampling.logprob_rows`: no log-softmax of the whole row written, no vocabulary
    sort) where it applies, else with torch."""
    out = cpu_sampling.logprob_rows(logits, targets, k)
    if out is not None:
        return out
    lp = torch.log_softmax(logits, dim=-1)  # [P, V]
    tgt = torch.tensor(targets, dtype=torch.long)
    tgt_lp = lp.gather(1, tgt.unsqueeze(1)).squeeze(1)  # [P]
    ranks = (lp > tgt_lp.unsqueeze(1)).sum(dim=1) + 1  # [P]
    if k:
        vals, idx = torch.topk(lp, k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in targets]
    return [(float(a), int(b), c) for a, b, c in zip(tgt_lp.tolist(), ranks.tolist(), tops)]


def prompt_logprobs(
    logits: torch.Tensor,  # [P, V] float32: logits at positions p, predicting token p + 1
    targets: list[int],  # [P] the actual next tokens
    k: int,
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Raw logprob and rank of each target, plus the top-k of each row (`logprob_stats`)."""
    return logprob_stats(logits, targets, k)
