"""Speculative decoding, the scheduler's side: the configuration (vLLM's `speculative_config`),
the proposals before each schedule (the method's `Proposer`, from the registry in
core/proposers/: n-gram, draft model), the per-batch on/off rule and the step update's rollback
of rejected tokens. Pure Python, no torch.

How a speculative step goes:

1. Before `Scheduler.schedule`, `SpecDecoder.propose` gives every running decoding sequence (one
   output token left to compute: never a prompt's last token) up to k draft tokens
   (`Sequence.spec_token_ids`), from its method's proposer: for "ngram", the tokens that
   followed the latest earlier occurrence of the sequence's last n tokens (n from
   `prompt_lookup_max` down to `prompt_lookup_min`). Proposals are capped so that accepting all
   of them plus the bonus token never passes `max_tokens` or `max_model_len`.
2. The scheduler plans such a sequence as a row of 1 + d tokens (the d drafts appended: lookahead
   slots in its block table; `ScheduledSequence.spec_token_ids`), within the token budget; when
   blocks are short it drops the lookahead before it preempts anybody.
3. The worker runs the row (causal within it) and verifies the drafts against the target's
   distribution at each position (worker/spec_verify.py): 1 .. d + 1 tokens come back.
4. `rewind` (from the step update): the row's computed tokens are the real one plus the accepted
   drafts; the rejected drafts' slots are given back (whole blocks freed), so the block table
   holds exactly the computed tokens again, and the prefix cache only ever sees accepted tokens.

NOTE: a sequence's `spec_token_ids` are only valid for its current tokens: the proposer sets them
for every running decoding sequence before each schedule, and the step update clears them for
every scheduled sequence (tokens change only there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from pagedserve.core.proposers import DRAFT_SLOT, PROPOSERS, DraftRow, Proposer  # noqa: F401
from pagedserve.core.proposers.ngram import ngram_propose  # noqa: F401 (re-exported)
from pagedserve.core.sched_types import ScheduledSequence
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.sequence import SequenceGroup

SPEC_METHODS = tuple(PROPOSERS)  # the registry's names (core/proposers/__init__.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `method` ("ngram", or "draft_model" implied by `model`),
    `num_speculative_tokens` (k), `prompt_lookup_max` / `prompt_lookup_min` (the n-gram sizes
    tried, longest first), `model` (a draft model sharing the target's tokenizer) and the per-batch
    rule `disable_by_batch_size`: no proposals in a step whose running decode sequences number
    more than this (None: never off; vLLM's name). `min_acceptance_rate`: a sequence whose drafts
    were accepted at less than this rate (after 4 drafts at least) stops proposing."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.0

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From a dict or a JSON object string (None stays None); ValueError naming
        `speculative_config` and the field for anything else."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object or a dict, got "
                             f"{type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "model", "disable_by_batch_size", "min_acceptance_rate"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        values = dict(value)
        method = values.get("method")
        if method is None:
            values["method"] = "draft_model" if values.get("model") else "ngram"
        elif method in ("draft", "draft_model"):
            values["method"] = "draft_model"
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        """ValueError naming the field when a value is out of range."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name}: {why}, got {getattr(self, name)!r}")

        if self.method not in PROPOSERS:  # (the registry as it is now: SPEC_METHODS is a copy)
            raise bad("method", f"must be one of {tuple(PROPOSERS)}")
        PROPOSERS[self.method].check_config(self)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "must be an integer >= 1")
        if self.num_speculative_tokens > 32:
            raise bad("num_speculative_tokens", "must be at most 32")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max "
                                           f"({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and (
                isinstance(self.disable_by_batch_size, bool)
                or not isinstance(self.disable_by_batch_size, int)
                or self.disable_by_batch_size < 1):
            raise bad("disable_by_batch_size", "must be an integer >= 1 (or null)")
        if not (isinstance(self.min_acceptance_rate, (int, float))
                and 0.0 <= self.min_acceptance_rate <= 1.0):
            raise bad("min_acceptance_rate", "must be in [0, 1]")


class SpecDecoder:
    """The engine's speculative decoding: proposals before each schedule (its method's
    `Proposer`: real tokens, or `DRAFT_SLOT` placeholders that the workers' draft model fills
    in), the on/off rule, and the counters behind the metrics (vLLM's names: drafts, draft
    tokens, accepted tokens, and accepted per draft position)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer: Proposer = PROPOSERS[config.method](config)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self.num_steps_off = 0  # steps the batch rule turned speculation off
        self.draft_seconds = 0.0  # time spent proposing (the n-gram lookups)
        self.step_seconds = 0.0  # engine steps' time, for the draft time share
        # per sequence: (drafts, accepted) so far, for the acceptance rule
        self._seq_stats: dict[int, list[int]] = {}

    def propose(self, running: Iterable[SequenceGroup], max_model_len: int,
                grammar=None) -> None:
        """Set `spec_token_ids` of every decoding sequence of the `running` groups (the
        scheduler's, in queue order; see the module docstring). `grammar(group, seq, drafts)`:
        the prefix of the drafts a structured-output sequence's grammar allows
        (`StructuredOutputManager.valid_drafts`); without it, or with a proposer whose drafts
        are placeholders, such a sequence does not speculate."""
        cfg = self.config
        decoding = []
        for group in running:
            if group.beam is not None or group.pooling is not None or group.fork_pending:
                for seq in group.seqs:  # (a forking parent's next token is its children's too)
                    seq.spec_token_ids = []
                continue
            for seq in group.seqs:
                if not seq.is_finished and not seq.parked and seq.num_output_tokens and (
                        seq.num_tokens - seq.num_computed_tokens == 1):
                    decoding.append((group, seq))
                else:
                    seq.spec_token_ids = []
        if cfg.disable_by_batch_size is not None and len(decoding) > cfg.disable_by_batch_size:
            for _, seq in decoding:
                seq.spec_token_ids = []
            self.num_steps_off += 1
            return
        proposer = self.proposer
        k = cfg.num_speculative_tokens
        batch: list[DraftRow] = []
        groups: list[SequenceGroup] = []
        for group, seq in decoding:
            params = group.sampling_params
            limit = k
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
            limit = min(limit, max_model_len - seq.num_tokens - 1)
            structured = params.structured_outputs is not None
            if limit < 1 or not self._worth_it(seq.seq_id) or structured and (
                    grammar is None or not proposer.supports_grammar):
                seq.spec_token_ids = []
                continue
            batch.append(DraftRow(seq, limit))
            groups.append(group)
        if not batch:
            return
        drafts = proposer.propose(batch)
        if len(drafts) != len(batch):
            raise RuntimeError(f"the {cfg.method!r} proposer gave {len(drafts)} drafts for "
                               f"{len(batch)} rows")
        for group, (seq, limit), tokens in zip(groups, batch, drafts):
            tokens = tokens[:limit]
            # NOTE: a grammar only ever sees drafts it allows (bitmask_for accepts them all)
            if group.sampling_params.structured_outputs is not None:
                tokens = grammar(group, seq, tokens)
            seq.spec_token_ids = tokens

    def _worth_it(self, seq_id: int) -> bool:
        rate = self.config.min_acceptance_rate
        if not rate:
            return True
        stats = self._seq_stats.get(seq_id)
        return stats is None or stats[0] < 4 or stats[1] >= rate * stats[0]

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """Count one verified draft of `num_drafts` tokens, `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        if self.config.min_acceptance_rate:
            stats = self._seq_stats.setdefault(seq_id, [0, 0])
            stats[0] += num_drafts
            stats[1] += num_accepted
        self.proposer.on_verified(seq_id, num_drafts, num_accepted)

    def forget(self, seq_ids) -> None:
        """Drop the per-sequence statistics of finished sequences (the proposer's too)."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._seq_stats.pop(seq_id, None)
        self.proposer.on_finished(seq_ids)

    def totals(self) -> tuple:
        """Cumulative counters (drafts, draft tokens, accepted tokens, accepted per position,
        proposal seconds, step seconds) for metrics listeners."""
        return (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                tuple(self.accepted_per_pos), self.draft_seconds, self.step_seconds)

    def summary(self) -> dict[str, float]:
        """Acceptance rate and mean accepted length (1 + accepted drafts per draft), vLLM's."""
        drafts = self.num_drafts
        return {
            "num_drafts": drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                if self.num_draft_tokens else 0.0),
            "mean_acceptance_length": (1 + self.num_accepted_tokens / drafts) if drafts else 0.0,
            "draft_time_share": (self.draft_seconds / self.step_seconds
                                 if self.step_seconds else 0.0),
            "steps_off": self.num_steps_off,
        }


def rewind(s: ScheduledSequence, r: SeqStepOutput) -> int:
    """After a speculative row: set the sequence's computed tokens to the real token plus the
    accepted drafts. Returns the number of accepted drafts. The caller then gives back the
    rejected drafts' slots (`Scheduler.truncate`: whole blocks freed, see
    `KVCacheManager.truncate`).

    NOTE: before the prefix cache sees the row's blocks: only accepted tokens are ever cached."""
    num_spec = len(s.spec_token_ids)
    accepted = max(0, min(num_spec, len(r.samples) - 1))
    s.seq.num_computed_tokens = s.end - num_spec + accepted
    return accepted


def drop_lookahead(plan: list) -> list:
    """`plan` ((seq, start, end) entries) without draft tokens: each row ends at its sequence's
    last real token."""
    return [(seq, start, min(end, seq.num_tokens)) for seq, start, end in plan]


def make_spec_decoder(args: Any, runner: str = "generate") -> SpecDecoder | None:
    """The engine's `SpecDecoder` for `args.speculative_config` (None: speculation off).
    ValueError for what it cannot serve: a pooling runner. (A draft model is loaded by the
    workers: `engine.spec_draft.resolve_draft`.)"""
    config = SpeculativeConfig.parse(getattr(args, "speculative_config", None))
    if config is None:
        return None
    if runner == "pooling":
        raise ValueError("speculative_config: the pooling runner decodes nothing")
    return SpecDecoder(config)


def record_spec_rows(spec: SpecDecoder | None, rows: list[tuple[int, int, int]]) -> None:
    """Count a step's speculative rows ((seq id, drafts, accepted), `StepUpdate.spec_rows`)."""
    if spec is not None:
        for seq_id, drafts, accepted in rows:
            spec.record(seq_id, drafts, accepted)
