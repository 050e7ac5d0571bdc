"""Requests as the scheduler sees them: sequences and sequence groups. Pure Python, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class PromptThenOutput:
    """`token_ids` holding the prompt then the output, split at `num_prompt_tokens` (shared by
    `Sequence` and the runner's per-row `core.step_input.SampleSpec`)."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class Sequence(PromptThenOutput):
    """One token stream: the prompt, the tokens generated so far, and how many of them have their
    K/V in the cache (`num_computed_tokens`).

    NOTE: `token_ids` is prompt + output in one list (appended in place every step); the tokens
    still to be computed are `token_ids[num_computed_tokens:]`. After preemption by recomputation
    `num_computed_tokens` drops to 0 and the whole list is prefilled again. The workers' mirror
    of it is kept by appending (`sent_tokens`, core/step_delta.py): only ever append to it.

    NOTE (step cost): `prompt_token_ids` is one list built once (do not mutate it), and
    `is_finished` a plain attribute kept by the `status` setter: both are read every step.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0) -> None:
        self.seq_id = seq_id
        # Its place among its request's samples (0 .. n-1): which random stream it draws from.
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self._prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.is_finished = False
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        # The request's cache_salt: roots its prefix-cache hashes (core/kv_cache_manager.py).
        self.cache_salt: str | None = None
        self.output_logprobs: list[dict[int, Any]] = []
        self.stop_reason: int | str | None = None
        # The output text cut at a stop string, once one matched (else the detokenizer's text).
        self.final_text: str | None = None
        # Set by the engine: incremental detokenizer of this sequence (opaque to the scheduler).
        self.detokenizer: Any = None
        # Set by the engine: the output token ids and logprobs lists its outputs hand out
        # (`engine.output_builder.HandedOut`; opaque to the scheduler).
        self.handed_tokens: Any = None
        self.handed_logprobs: Any = None
        # Set by the step input (`core.step_input`): [its own `SampleSpec`], made once.
        self.own_samples: Any = None
        # Beam search: this beam's best (token, logprob) continuations, until the step selects.
        self.beam_candidates: list[tuple[int, float]] | None = None
        # NOTE: a parked sequence (of a group whose sequences take turns, core/scheduler.py)
        # holds no blocks and has num_computed_tokens 0 until its turn comes.
        self.parked = False
        # Speculative decoding: draft tokens proposed to follow `token_ids` (core/spec_decode.py);
        # valid only for the current tokens (the step update clears them).
        self.spec_token_ids: list[int] = []
        # The tokens the workers' mirror holds (core/step_delta.py); -1: they do not know it.
        self.sent_tokens = -1
        # A recurrent-state model's prefix caching: where its prompt's cached attention blocks
        # end beyond any state snapshot (the junction with an earlier request, set at
        # admission): a prompt chunk ends there so that its state is snapshotted (0: none).
        self.snapshot_at = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, value: SequenceStatus) -> None:
        self._status = value
        self.is_finished = value.is_finished

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences (n > 1 runs them side by side), sampling parameters and timings.

    NOTE: a group is scheduled, preempted and resumed as a whole (all-or-nothing), except that a
    group alone in the cache that cannot hold all its sequences runs them in turns (parked
    sequences, see core/scheduler.py). Groups compare by identity (`eq=False`): queue membership
    must never compare fields.
    """

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Set once the prompt logprobs have been computed (never again after a recomputation).
    prompt_logprobs_done: bool = False
    # NOTE: while True, only seqs[0] (the parent) is scheduled: the prompt is prefilled once and
    # the other sequences fork its block table when the first tokens are sampled.
    fork_pending: bool = False
    # Beam search state (`core.beam_search.BeamState`) when the request is a beam search.
    beam: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The request's adapter (`lora.request.LoRARequest`; multi-LoRA serving), None: the base model.
    lora_request: Any = None
    # Prompt tokens found in the prefix cache when first admitted (None: not admitted yet).
    num_cached_tokens: int | None = None
    # A pooling request (`pooling_params.PoolingSpec`): prefill only, it finishes when its prompt
    # is computed, with the runner's result in `pooled` (opaque here).
    pooling: Any = None
    pooled: Any = None
    # Scheduling priority (scheduling_policy="priority"): lower values are served first.
    priority: int = 0
    # Set by `Scheduler.add`: the order requests were queued in (ties of the queue keys).
    queue_no: int = 0
    # The workers hold the request (its parameters travelled: core/step_delta.py).
    sent: bool = False

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    @property
    def max_width(self) -> int:
        """The most sequences this request ever runs at once: n (or best_of), or the beam width."""
        params = self.sampling_params
        return params.n if self.beam is not None else max(params.best_of or params.n, len(self.seqs))

    @property
    def max_width_left(self) -> int:
        """Sequences the group may still run at once (scheduler slots it takes while running):
        its unfinished sequences, or the beam width for a beam search (beams fork)."""
        return self.sampling_params.n if self.beam is not None else len(self.unfinished_seqs())

    def unfinished_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, without a comprehension
            return [] if seqs[0].is_finished else [seqs[0]]
        return [s for s in seqs if not s.is_finished]

    def parked_seqs(self) -> list[Sequence]:
        """Unfinished sequences waiting their turn (holding no blocks), in order (a group of
        one sequence never has any)."""
        if len(self.seqs) == 1:
            return []
        return [s for s in self.seqs if s.parked and not s.is_finished]

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:
            if not s.is_finished:
                return False
        return True

    @property
    def needs_logprobs(self) -> bool:
        """Whether chosen tokens' logprobs are needed (asked for, or to rank best_of)."""
        p = self.sampling_params
        return p.logprobs is not None or (p.best_of or p.n) > p.n
