"""Speculative decoding's proposers (`speculative_config.method` -> a `Proposer` class), one
file each; the interface is `core/proposers/base.py`. A new method: its file, and its line here.
Pure Python, no torch."""

from __future__ import annotations

from pagedserve.core.proposers.base import DRAFT_SLOT, DraftRow, Proposer
from pagedserve.core.proposers.draft_model import DraftModelProposer
from pagedserve.core.proposers.ngram import NgramProposer

PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "draft_model": DraftModelProposer,
}

__all__ = ["DRAFT_SLOT", "PROPOSERS", "DraftRow", "Proposer"]
