"""What an engine allows a model with recurrent layers (Gated DeltaNet, Mamba: a state per
sequence kept in cache entries, `core.kv_spec.RecurrentStateSpec`, `layers.recurrent_state`).

Its state is rewritten in place every step: a speculative row keeps the state it starts from
until its drafts are verified, and rolls back to it when one is rejected
(core/state_rollback.py); a draft model, which follows the target's one block table, is refused.
Prefix caching keeps snapshots of it at block boundaries instead of matching its blocks
(core/state_snapshots.py); its cache entries are sized for one block size and storage dtype
(refitted by `reconfigure_cache`)."""

from __future__ import annotations

import logging

import torch

from pagedserve.core.kv_spec import RecurrentStateSpec

logger = logging.getLogger(__name__)


def has_recurrent_state(spec) -> bool:
    """Whether a model's KV spec (`models.base.KVCacheSpec`) holds a recurrent state."""
    return any(isinstance(s, RecurrentStateSpec) for s in spec.layer_specs())


def check_recurrent_state(name: str, *, draft_model: bool, prefix_caching: bool) -> None:
    """ValueError naming `speculative_config.model` for a draft model beside a model with a
    recurrent state (the draft's cache follows the target's tables in one group, which a state
    group cannot join); with prefix caching, logs how its state is cached."""
    if draft_model:
        raise ValueError(f"speculative_config.model: {name} keeps a recurrent state, whose cache "
                         "cannot share its block tables with a draft model; use a method "
                         "without one (\"ngram\")")
    if prefix_caching:
        logger.info("prefix caching for %s keeps snapshots of its recurrent state at block "
                    "boundaries (each block_size decode tokens, chunk ends, a prompt's last "
                    "full block): a prefix hits up to the last snapshot it holds", name)


def rebind_recurrent_state(executor, block_size: int, kv_dtype: torch.dtype) -> None:
    """Refit every worker's recurrent state entries to another block size or cache dtype
    (`reconfigure_cache`), and the executor's KV spec with them. ValueError where the executor
    cannot reach its workers' models (no `collective_rpc`)."""
    try:
        specs = executor.collective_rpc("bind_cache", (block_size, kv_dtype))
    except NotImplementedError as e:
        raise ValueError("block_size / kv_cache_dtype: a model with a recurrent state keeps the "
                         f"ones it was loaded with on {type(executor).__name__}") from e
    executor.kv_cache_spec = specs[0]
