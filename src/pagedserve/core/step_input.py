"""One step as the model workers see it: flat, plain data. Pure Python, no torch.

`StepInput.from_schedule` turns the scheduler's `SchedulerOutput` (which refers to its own
`SequenceGroup` / `Sequence` objects) into rows of token ids, positions, block tables and
sampling specs, with the scheduler's `StepDelta` (what the workers' mirrors must change,
core/step_delta.py); every executor packs the delta and the rows' spans into a
`worker.step_message.StepMessage` for its `Worker`s (in process too), and the model runner reads
nothing else.

NOTE: for the in-process executor the token and block-table lists are the scheduler's own
(no copies): the runner must only read them, and only during the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.core.step_delta import StepDelta
from pagedserve.pooling_params import PoolingSpec
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import PromptThenOutput

if TYPE_CHECKING:
    from pagedserve.core.scheduler import SchedulerOutput


@dataclass
class SampleSpec(PromptThenOutput):
    """One token drawn from a row's logits, for one sequence: its id, its sample index (which
    random stream it draws from), and its tokens (prompt + output; penalties read them)."""

    seq_id: int
    index: int
    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class StepRow:
    """One sequence's tokens to compute this step: `token_ids[start:end]` at positions
    `start .. end - 1`, writing and reading the KV cache through `block_table`."""

    request_id: str
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    start: int
    end: int
    block_table: list[int]
    params: SamplingParams
    # The step reaches the sequence's last token: its last logits row is used.
    do_sample: bool = False
    # Logprobs of the prompt positions start+1 .. end (top `params.prompt_logprobs`).
    prompt_logprobs: bool = False
    # Tokens to draw from the row's last position (when `do_sample`, beam search aside): one, or
    # one per sequence of a group that forks after its shared prompt.
    samples: list[SampleSpec] = field(default_factory=list)
    # Beam search (width > 0): at the sequence's end, return the best 2 * beam_width
    # (token, logprob) candidates instead of sampling.
    beam_width: int = 0
    # The chosen tokens' logprobs are needed (asked for, or to rank best_of).
    need_logprob: bool = False
    # A pooling request (every chunk of its prompt): its hidden states are pooled, nothing is
    # sampled; the pooled result comes back with the chunk that reaches the end (`do_sample`).
    pooling: PoolingSpec | None = None
    # Speculative decoding: draft tokens after the sequence's last token, verified this step;
    # `end` counts them (the row computes `token_ids[start:end - d] + spec_token_ids`).
    spec_token_ids: list[int] = field(default_factory=list)
    # The request's adapter (`lora.request.LoRARequest`, multi-LoRA serving), None: the base model.
    lora_request: object | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def input_ids(self) -> list[int]:
        """The tokens this row computes (its draft tokens last)."""
        spec = self.spec_token_ids
        if spec:
            return self.token_ids[self.start : self.end - len(spec)] + spec
        return self.token_ids[self.start : self.end]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInput:
    """Everything a worker needs for one step (see the module docstring)."""

    rows: list[StepRow] = field(default_factory=list)
    # NOTE: applied in this order before the forward pass; see SchedulerOutput.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    # Requests that ended, and single sequences that left their request (pruned beams), since
    # the last step: workers drop their state.
    finished_request_ids: list[str] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)
    # Structured outputs: the constrained sequences' token bitmasks (a
    # `structured_output.bitmask.GrammarBitmask`, plain data), set by the engine.
    grammar_bitmask: object | None = None
    # What the workers' mirrors must change for this step (the scheduler's `StepDelta`, which
    # the executors' `StepEncoder` packs); None for a step built by hand (not sent to workers).
    delta: StepDelta | None = None

    @classmethod
    def from_schedule(cls, sched: "SchedulerOutput") -> "StepInput":
        rows = []
        append = rows.append
        # NOTE (step cost): one row per scheduled sequence every step: positional arguments (in
        # StepRow's field order), and a sequence's one sample spec without a slice.
        for s in sched.scheduled:
            group, seq = s.group, s.seq
            beam = group.beam
            beam_width = beam.params.beam_width if beam is not None else 0
            samples: list[SampleSpec] = []
            if s.do_sample and not beam_width and group.pooling is None:
                if s.num_samples > 1:
                    samples = [SampleSpec(q.seq_id, q.index, q.token_ids, q.num_prompt_tokens)
                               for q in group.seqs[: s.num_samples]]
                else:
                    # NOTE (step cost): a sequence's own one sample spec is made once and kept
                    # (plain data that never changes, its token list the sequence's own).
                    samples = seq.own_samples
                    if samples is None or samples[0].token_ids is not seq.token_ids:
                        samples = seq.own_samples = [SampleSpec(
                            seq.seq_id, seq.index, seq.token_ids, seq.num_prompt_tokens)]
            append(StepRow(
                group.request_id, seq.seq_id, seq.token_ids, seq.num_prompt_tokens, s.start,
                s.end, s.block_table, group.sampling_params, s.do_sample,
                s.wants_prompt_logprobs, samples, beam_width, group.needs_logprobs,
                group.pooling, s.spec_token_ids, group.lora_request))
        return cls(rows, sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy,
                   sched.finished_request_ids, sched.freed_seq_ids, None, sched.delta)
