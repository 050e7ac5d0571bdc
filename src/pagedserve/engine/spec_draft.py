"""Speculative decoding with a draft model, the engine's side: for a method whose proposer uses
one (`Proposer.uses_draft_model`: core/proposers/draft_model.py), finding the draft model
(`speculative_config.model`) and checking that it shares the target's vocabulary, before any
worker loads it. The workers load and run it (worker/spec_draft.py)."""

from __future__ import annotations

import logging
from typing import Any

from pagedserve.core.proposers import PROPOSERS
from pagedserve.core.spec_decode import SpeculativeConfig
from pagedserve.models.source import ModelSource, resolve_model

logger = logging.getLogger(__name__)


def _vocab_size(config: Any) -> int:
    return int((getattr(config, "text_config", None) or config).vocab_size)


def resolve_draft(args: Any, target: ModelSource) -> ModelSource | None:
    """The draft model's source for `args.speculative_config` (None: no draft model).
    ValueError naming `speculative_config.model` when it cannot be found or read, when its
    vocabulary size is not the target's, or when the engine cannot run one (tensor parallelism,
    the pooling runner)."""
    config = SpeculativeConfig.parse(getattr(args, "speculative_config", None))
    if config is None or not PROPOSERS[config.method].uses_draft_model:
        return None
    if getattr(args, "tensor_parallel_size", 1) > 1:
        raise ValueError("speculative_config.model: a draft model runs with "
                         "tensor_parallel_size=1 only")
    try:
        draft = resolve_model(config.model)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config.model: cannot load the draft model "
                         f"{config.model!r}: {exc}") from None
    want, got = _vocab_size(target.config), _vocab_size(draft.config)
    if got != want:
        raise ValueError(f"speculative_config.model: the draft model {config.model!r} has a "
                         f"vocabulary of {got} tokens, the target {want}: a draft model must "
                         "share the target's tokenizer")
    return draft


def check_draft_tokenizer(draft: ModelSource | None, tokenizer: Any) -> None:
    """ValueError naming `speculative_config.model` when the draft's own tokenizer (if it has
    one) maps tokens to other ids than the target's `tokenizer`."""
    if draft is None or tokenizer is None:
        return
    try:
        theirs = draft.load_tokenizer()
    except Exception as exc:  # noqa: BLE001 - no tokenizer of its own: the target's is assumed
        logger.info("draft model %s: no tokenizer of its own (%s); assuming the target's",
                    draft.name, exc)
        return
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model: the draft model {draft.name!r} has another "
                         "tokenizer than the target (their vocabularies differ): a draft model "
                         "must share the target's tokenizer")
