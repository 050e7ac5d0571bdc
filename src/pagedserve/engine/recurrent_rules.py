"""What an engine allows a model with recurrent layers (Gated DeltaNet, Mamba: a state per
sequence kept in cache entries, `core.kv_spec.RecurrentStateSpec`, `layers.recurrent_state`).

Its state is rewritten in place every step, so it cannot be rolled back (speculative decoding's
rejected drafts) nor matched by prefix (prefix caching: the block manager turns it off), and its
cache entries were sized at load for one block size and storage dtype."""

from __future__ import annotations

import logging

import torch

from pagedserve.core.kv_spec import RecurrentStateSpec

logger = logging.getLogger(__name__)


def has_recurrent_state(spec) -> bool:
    """Whether a model's KV spec (`models.base.KVCacheSpec`) holds a recurrent state."""
    return any(isinstance(s, RecurrentStateSpec) for s in spec.layer_specs())


def check_recurrent_state(name: str, *, speculative: bool, loaded: tuple[int, torch.dtype],
                          wanted: tuple[int, torch.dtype], prefix_caching: bool) -> None:
    """ValueError naming the setting a model with a recurrent state cannot take: speculative
    decoding (`speculative_config`), or a (block_size, cache dtype) other than `loaded`, the
    ones its state entries were sized for (reconfigure_cache). Prefix caching is only logged:
    it is off for such a model."""
    if speculative:
        raise ValueError(f"speculative_config: {name} keeps a recurrent state, which cannot "
                         "roll back rejected draft tokens")
    if wanted != loaded:
        raise ValueError("block_size / kv_cache_dtype: a model with a recurrent state keeps "
                         f"the ones it was loaded with ({loaded[0]}, {loaded[1]})")
    if prefix_caching:
        logger.info("prefix caching is off for %s: its recurrent state is no function of a "
                    "block's tokens", name)
