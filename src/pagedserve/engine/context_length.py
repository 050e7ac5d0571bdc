"""The context length an engine serves: the user's `max_model_len`, checked before the model loads
against the checkpoint's position limit and against what the model class serves exactly (a
class's `context_limit`, e.g. Llama 4's attention chunk); without one, the smaller of the two."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def served_max_model_len(requested: int | None, config, text_config) -> int:
    """The context served: `requested` (EngineArgs.max_model_len), else the model's limit (2048
    for a config declaring none, which then takes any `requested`: Mamba's).
    ValueError (before the model loads) past `max_position_embeddings`, or past what the model
    class serves exactly (`models.registry.context_limit`: Llama 4's attention_chunk_size, whose
    class names it in its own error); without `requested`, the smaller of the two."""
    from pagedserve.models.registry import context_limit, get_model_class

    declared = getattr(text_config, "max_position_embeddings", None)
    max_pos = int(declared or 2048)
    limit = context_limit(config)
    if declared is None and requested is not None and limit is None:
        # no position limit declared (a pure state-space model: Mamba): the request as vLLM
        # takes it; 2048 when none
        return requested
    if requested is None and limit is not None and limit < max_pos:
        logger.warning("max_model_len defaults to %d, the longest context %s serves exactly (its "
                       "max_position_embeddings is %d)", limit, type(text_config).__name__, max_pos)
        return limit
    max_model_len = requested or max_pos
    if max_model_len > max_pos:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's "
            f"max_position_embeddings ({max_pos})"
        )
    if limit is not None and max_model_len > limit:
        check = getattr(get_model_class(config), "check_max_model_len", None)
        if check is not None:  # the family's own words (which option limits it)
            check(config, max_model_len)
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the longest context the model "
                         f"serves exactly ({limit})")
    return max_model_len
