"""Beam search inside the engine: parameters, the per-step selection, and its outputs.

One request is one sequence group whose live sequences are the beams. Each step every beam's row
yields its best `2 * beam_width` (token, raw logprob) candidates; `select` ranks all extensions by
cumulative logprob and keeps the best `beam_width` that do not end in EOS. Children fork their
parent's block table (shared blocks, copy-on-write of the last partial block on the next write);
dropped beams free theirs. Pure Python, no torch.

Semantics (documented differences):
- cumulative logprob = sum of the raw log-softmax values of the chosen tokens;
- a candidate ending in EOS (unless `ignore_eos`) ranked among the best `beam_width` extensions
  becomes a finished hypothesis, kept aside as HF transformers does; its score is
  `cum_logprob / (output_len ** length_penalty)`, output_len counting the EOS token;
- the search ends at `max_tokens`, or early (HF's `early_stopping=False` heuristic) once
  `beam_width` hypotheses are finished and none of the live beams' current scores beats the worst
  of them; live beams are then hypotheses too, and the best `beam_width` by score are returned.
- Unlike vLLM (which runs beam search outside its engine, one request per beam and step), the
  search here is one sequence group, preempted and resumed as one. Unlike HF, EOS is allowed as a
  plain token under `ignore_eos` (HF bans it through `min_new_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError("temperature must be 0 for beam search (it ranks raw logprobs)")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != \
                self.length_penalty:
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, cumulative logprob and score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamState:
    """Per-request beam search state kept on the sequence group."""

    params: BeamSearchParams
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False


@dataclass
class Extension:
    """One chosen continuation: beam `parent` (index into the live beams) extended by `token`."""

    parent: int
    token: int
    logprob: float
    cum_logprob: float


def score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / (max(length, 1) ** length_penalty)


def select(
    state: BeamState,
    beams: list[tuple[float, int, list[int]]],  # (cum logprob, output length, output tokens)
    candidates: list[list[tuple[int, float]]],  # per beam: (token, raw logprob), best first
    eos_ids: set[int],
) -> list[Extension]:
    """One beam-search step: the extensions that become the next live beams (best first).
    Finished hypotheses are added to `state`; `state.done` is set when the search is over."""
    p = state.params
    k = p.beam_width
    ranked = sorted(
        ((cum + lp, -i, -j, i, tok, lp) for i, ((cum, _, _), cands) in enumerate(
            zip(beams, candidates)) for j, (tok, lp) in enumerate(cands)),
        reverse=True,
    )[: 2 * k]
    nxt: list[Extension] = []
    for rank, (total, _, _, i, tok, lp) in enumerate(ranked):
        if not p.ignore_eos and tok in eos_ids:
            if rank < k:
                _, length, tokens = beams[i]
                state.finished.append(Hypothesis(
                    tokens + [tok], total, score(total, length + 1, p.length_penalty), "stop"))
            continue
        nxt.append(Extension(i, tok, lp, total))
        if len(nxt) == k:
            break
    new_len = beams[0][1] + 1 if beams else 1
    if new_len >= p.max_tokens or not nxt:
        state.done = True
    elif len(state.finished) >= k:
        worst = sorted(h.score for h in state.finished)[-k]
        best_live = max(score(e.cum_logprob, new_len, p.length_penalty) for e in nxt)
        state.done = worst >= best_live
    return nxt


def final_hypotheses(state: BeamState, live: list[tuple[float, list[int]]]) -> list[Hypothesis]:
    """The best `beam_width` of the finished hypotheses and the live beams, best first."""
    p = state.params
    pool = list(state.finished) + [
        Hypothesis(tokens, cum, score(cum, len(tokens), p.length_penalty), "length")
        for cum, tokens in live
    ]
    pool.sort(key=lambda h: h.score, reverse=True)
    return pool[: p.beam_width]


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's shape): `tokens` are prompt + output."""

    tokens: list[int]
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
