"""What the model runner hands back for one step, as plain data. Pure Python, no torch.

The scheduler applies these in `Scheduler.update_from_output`; the runner builds them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SampleResult:
    """The chosen token of one row, its raw logprob and rank, and the top-k when asked."""

    token_id: int
    logprob: float | None
    rank: int | None
    top_logprobs: list[tuple[int, float]] | None  # [(token, logprob)] best first


@dataclass
class SeqStepOutput:
    """What one scheduled sequence got from this step."""

    seq_id: int
    # One result per sequence this row samples for: empty when the step did not reach the
    # sequence's end; `num_samples` results when the group forks after its shared prefill.
    samples: list[SampleResult]
    # (logprob, rank, top-k) for each prompt position start+1 .. end of this chunk, if asked
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    # Beam search: the row's best 2 * beam_width (token, raw logprob), best first.
    beam_candidates: list[tuple[int, float]] | None = None
    # Pooling: the request's pooled hidden states once its prompt is computed (a float32 CPU
    # tensor from the runner). NOTE: opaque here: the scheduler hands it to the group unread.
    pooled: object | None = None
