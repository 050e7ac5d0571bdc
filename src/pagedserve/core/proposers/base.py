"""The proposer interface of speculative decoding: `Proposer.propose(batch) -> drafts`, with its
state hooks. Pure Python, no torch.

`core.spec_decode.SpecDecoder` calls its proposer once before each schedule with the running
decoding sequences that may speculate (the limits, the batch rule, the acceptance rule and
structured outputs already applied: see that module), and sets each sequence's
`spec_token_ids` to what comes back. A proposer returns real token ids, or `DRAFT_SLOT`
placeholders that the workers' draft model fills in before the target verifies the row
(`uses_draft_model`: worker/spec_draft.py). Either way the rows are verified exactly
(worker/spec_verify.py): a proposer only changes how many tokens are accepted, never which.

A new method is one file in this package, a `Proposer` subclass, and one line in the registry
(`core/proposers/__init__.py`).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from pagedserve.sequence import Sequence

# A draft-model proposal's placeholder: the scheduler plans the slot, the worker's draft model
# fills it in (worker/spec_draft.py) before the target verifies the row.
DRAFT_SLOT = -1


class DraftRow(NamedTuple):
    """One sequence of a proposer's batch: `seq` (read its `token_ids`, `seq_id`; change
    nothing) and `limit`, the most drafts it may take (>= 1: accepting them all plus the bonus
    token stays within `max_tokens` and `max_model_len`)."""

    seq: Sequence
    limit: int


class Proposer:
    """A speculative method: drafts for a batch of decoding sequences, plus state hooks.

    Class attributes: `name` (the `speculative_config.method` it serves), `uses_draft_model`
    (it proposes `DRAFT_SLOT`s: every worker loads `speculative_config.model` beside the target
    and fills them), `supports_grammar` (its drafts are real tokens, so a structured-output
    sequence may speculate with the prefix its grammar allows).
    """

    name: ClassVar[str] = ""
    uses_draft_model: ClassVar[bool] = False
    supports_grammar: ClassVar[bool] = True

    def __init__(self, config: Any) -> None:
        self.config = config  # the `core.spec_decode.SpeculativeConfig`

    @classmethod
    def check_config(cls, config: Any) -> None:
        """ValueError naming the `speculative_config` field this method cannot take."""

    def propose(self, batch: list[DraftRow]) -> list[list[int]]:
        """The drafts of each row, in order: at most `row.limit` tokens each ([]: none)."""
        raise NotImplementedError

    # --- state hooks (no-ops unless the method keeps state) ------------------------------------

    def on_verified(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A row of `num_drafts` drafts of `seq_id` was verified: `num_accepted` were taken."""

    def on_finished(self, seq_ids) -> None:
        """These sequences ended (or were dropped): forget what is kept for them."""
