"""The draft-model proposer (vLLM's "draft_model"): a small model sharing the target's
tokenizer drafts greedily. The scheduler's side only plans the slots (`DRAFT_SLOT`s, as many as
each row may take); every worker loads `speculative_config.model` beside the target
(engine/spec_draft.py finds and checks it) and its `worker.spec_draft.DraftProposer` fills the
slots before the target's forward."""

from __future__ import annotations

from typing import Any

from pagedserve.core.proposers.base import DRAFT_SLOT, DraftRow, Proposer


class DraftModelProposer(Proposer):
    """Placeholders for the workers' draft model (see the module docstring)."""

    name = "draft_model"
    uses_draft_model = True
    supports_grammar = False  # (the slots are filled after the grammar could cut them)

    @classmethod
    def check_config(cls, config: Any) -> None:
        if not config.model:
            raise ValueError(f"speculative_config.model: a draft model needs its path, got "
                             f"{config.model!r}")

    def propose(self, batch: list[DraftRow]) -> list[list[int]]:
        return [[DRAFT_SLOT] * limit for _, limit in batch]
