"""Applying a step's results to the scheduler's state (`Scheduler.update_from_output`). Pure
Python, no torch.

For every scheduled sequence, in order: its computed tokens advance, its newly full blocks are
offered to the prefix cache, a forking group's other sequences fork the parent once the shared
prompt is computed, a pooling request finishes with its pooled result (prefill only), sampled
tokens are appended and checked against the token-level stops (EOS, stop token ids after
`min_tokens`, `max_tokens`, `max_model_len`; a speculative row appends its accepted drafts and
the next token, one by one, until a stop, and gives back its rejected drafts' slots), beam
candidates are collected and, once every live beam has its candidates, the beam step forks,
extends and prunes. Finished sequences free their
blocks; finished groups leave `running`; a sliding-window group gives back the blocks its window
left behind (`KVCacheManager.free_out_of_window`).

The engine plugs in what needs a tokenizer through a `StepObserver`: prompt logprob entries,
token logprob entries, incremental detokenization and stop strings. The scheduler is reached
only through `StepTarget`, the small interface it implements for this module (its limits, its
KV decisions, forks and finishes): nothing here reads its queues, block manager or config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.core.beam_search import Extension, final_hypotheses, select
from pagedserve.core.sched_types import ScheduledSequence, SchedulerOutput
from pagedserve.core.spec_decode import rewind
from pagedserve.core.step_output import SampleResult, SeqStepOutput
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


class StepTarget(Protocol):
    """What the step update asks of the scheduler (`core.scheduler.Scheduler` implements it)."""

    max_model_len: int  # (read-only properties on the scheduler)
    eos_token_ids: tuple[int, ...]
    prefix_caching: bool  # `cache_computed_blocks` has work to do
    sliding_window: bool  # `free_out_of_window` has work to do

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""

    def free_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks no query of the sequence reaches any more."""

    def end_step(self) -> None:
        """The step has run: the blocks the prefix cache pinned for its copies are let go."""

    def truncate(self, seq: Sequence, start: int = 0, all_accepted: bool = True) -> None:
        """Give back the slots past `seq.num_computed_tokens` (rejected drafts; a recurrent
        state rolled back to the row's `start` unless `all_accepted`)."""

    def fork_if_ready(self, group: SequenceGroup) -> list[Sequence]:
        """A forking group's sequences share its parent's computed prompt (once it is)."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares the parent's blocks and computed tokens."""

    def drop_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Remove a pruned beam from its group, freeing its blocks."""

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """End one sequence and free its blocks."""

    def remove_finished(self, candidates: list[SequenceGroup]) -> list[SequenceGroup]:
        """Finished groups among `candidates` leave the running queue."""

    def new_seq_id(self) -> int:
        """An id for a forked beam."""


class StepObserver(Protocol):
    """The engine's part of a step update (text and logprob formatting)."""

    def on_prompt_logprobs(self, scheduled: ScheduledSequence, output: SeqStepOutput) -> None:
        """Record the prompt logprobs a prompt chunk produced (`group.prompt_logprobs`)."""

    def on_token(self, group: SequenceGroup, seq: Sequence, sample: SampleResult,
                 check_stop: bool, stops: bool) -> bool:
        """A token was appended to `seq`: record its logprobs, detokenize it, and when
        `check_stop` look for a stop string; returns True if one matched (the sequence stops).
        `stops`: the token ends the sequence as an EOS or stop token id."""


@dataclass
class StepUpdate:
    """What a step changed: the groups that produced tokens or finished (in order), and counts."""

    groups: list[SequenceGroup] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # Speculative decoding: (seq id, draft tokens verified, accepted) of each speculative row.
    spec_rows: list[tuple[int, int, int]] = field(default_factory=list)


def apply_step(scheduler: StepTarget, sched: SchedulerOutput, results: list[SeqStepOutput],
               observer: StepObserver | None) -> StepUpdate:
    """Apply one step's results; see the module docstring."""
    update = StepUpdate()
    touched: dict[str, SequenceGroup] = {}
    # The groups that may have finished in this step (a sequence of theirs ended, or a row
    # that may end several): the only ones `remove_finished` looks at.
    ended: dict[str, SequenceGroup] = {}
    beams: dict[str, SequenceGroup] = {}
    caching = scheduler.prefix_caching
    # A sliding-window group gives back the blocks no query of the sequence reaches any more.
    sliding = scheduler.sliding_window
    eos_ids, max_len = scheduler.eos_token_ids, scheduler.max_model_len  # token-level stops
    # NOTE (step cost): counted in locals, and a row's one sampled token (the common case)
    # appended without building a list of sequences.
    num_prompt = num_generated = 0
    for s, r in zip(sched.scheduled, results):
        group, seq = s.group, s.seq
        if s.spec_token_ids:  # drafts verified: computed up to the accepted ones, rest given back
            accepted = rewind(s, r)
            update.spec_rows.append((seq.seq_id, len(s.spec_token_ids), accepted))
            scheduler.truncate(seq, s.start, accepted == len(s.spec_token_ids))
        else:
            seq.num_computed_tokens = s.end
        if seq.spec_token_ids:
            seq.spec_token_ids = []
        if caching:
            scheduler.cache_computed_blocks(seq)
        if sliding:  # (after the prefix cache took the newly full blocks)
            scheduler.free_out_of_window(seq)
        if s.start < seq.num_prompt_tokens:
            num_prompt += min(s.end, seq.num_prompt_tokens) - s.start
        if r.prompt_logprobs is not None:
            if observer is not None:
                observer.on_prompt_logprobs(s, r)
            if s.end >= seq.num_prompt_tokens:
                group.prompt_logprobs_done = True
        # The shared prompt is computed: the other sequences fork the parent's blocks.
        forked = scheduler.fork_if_ready(group) if group.fork_pending else ()
        samples = r.samples
        if r.pooled is not None:  # a pooling request ends with its prompt: nothing is decoded
            group.pooled = r.pooled
            scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
            touched[group.request_id] = ended[group.request_id] = group
        elif samples:
            if s.spec_token_ids:  # the accepted drafts and the next token, until a stop
                for sample in samples:
                    _append_token(scheduler, group, seq, sample, observer, eos_ids, max_len)
                    num_generated += 1
                    if seq.is_finished:
                        break
                ended[group.request_id] = group
            elif len(samples) == 1:
                _append_token(scheduler, group, seq, samples[0], observer, eos_ids, max_len)
                num_generated += 1
                if seq.is_finished:
                    ended[group.request_id] = group
            else:
                for q, sample in zip(forked, samples):
                    _append_token(scheduler, group, q, sample, observer, eos_ids, max_len)
                    num_generated += 1
                ended[group.request_id] = group
            touched[group.request_id] = group
        elif r.beam_candidates is not None:
            seq.beam_candidates = r.beam_candidates
            beams[group.request_id] = group
    for group in beams.values():
        if all(q.beam_candidates is not None for q in group.unfinished_seqs()):
            num_generated += _beam_step(scheduler, group)
            touched[group.request_id] = ended[group.request_id] = group
    for group in sched.length_capped:
        touched[group.request_id] = group
    update.num_prompt_tokens = num_prompt
    update.num_generated_tokens = num_generated
    update.groups = list(touched.values())
    # NOTE: only the groups this step touched can have finished, and of those only the ones a
    # sequence of which ended (length-capped groups left `running` already): nothing else is
    # scanned.
    scheduler.remove_finished(list(ended.values()))
    if caching:
        scheduler.end_step()
    return update


def _append_token(scheduler: StepTarget, group: SequenceGroup, seq: Sequence,
                  sample: SampleResult, observer: StepObserver | None,
                  eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
    params = group.sampling_params
    token = sample.token_id
    token_ids = seq.token_ids
    token_ids.append(token)  # (Sequence.append_token, inlined: once per token)
    seq.cumulative_logprob += sample.logprob or 0.0
    if group.first_token_time is None:
        group.first_token_time = time.monotonic()
    num_tokens = len(token_ids)
    n_out = num_tokens - seq.num_prompt_tokens
    status = None
    past_min = n_out >= params.min_tokens
    if past_min:
        if not params.ignore_eos and token in eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif params.stop_token_ids and token in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
    if observer is not None and observer.on_token(group, seq, sample,
                                                   status is None and past_min,
                                                   status is not None):
        status = SequenceStatus.FINISHED_STOPPED
    if status is None:
        max_tokens = params.max_tokens
        if ((max_tokens is not None and n_out >= max_tokens)
                or num_tokens >= max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
    if status is not None:
        scheduler.finish_seq(seq, status)


def _beam_step(scheduler: StepTarget, group: SequenceGroup) -> int:
    """Select the next beams from every live beam's candidates; fork, extend and prune.
    Returns the number of tokens appended."""
    state = group.beam
    live = group.unfinished_seqs()
    chosen = select(
        state,
        [(q.cumulative_logprob, q.num_output_tokens, q.output_token_ids) for q in live],
        [q.beam_candidates for q in live],
        set(scheduler.eos_token_ids),
    )
    extended: list[tuple[Sequence, Extension]] = []
    taken: set[int] = set()
    for ext in chosen:  # forks first: a child copies its parent before the parent grows
        parent = live[ext.parent]
        if ext.parent in taken:
            child = Sequence(scheduler.new_seq_id(), parent.prompt_token_ids)
            child.cache_salt = parent.cache_salt
            child.token_ids = list(parent.token_ids)
            scheduler.fork(parent, child)
            group.seqs.append(child)
            extended.append((child, ext))
        else:
            taken.add(ext.parent)
            extended.append((parent, ext))
    for i, q in enumerate(live):
        q.beam_candidates = None
        if i not in taken:
            scheduler.drop_seq(group, q)
    for seq, ext in extended:
        seq.token_ids.append(ext.token)
        seq.cumulative_logprob = ext.cum_logprob
    if group.first_token_time is None:
        group.first_token_time = time.monotonic()
    beams = [seq for seq, _ in extended]
    if state.done or not beams or beams[0].num_tokens >= scheduler.max_model_len:
        group.extra["beam_final"] = final_hypotheses(
            state, [(q.cumulative_logprob, q.output_token_ids) for q in beams])
        for q in beams:
            scheduler.finish_seq(q, SequenceStatus.FINISHED_LENGTH)
    return len(extended)
