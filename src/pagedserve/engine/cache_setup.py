"""The KV cache an `LLMEngine` builds for its cache settings (a mixin): the block count (given,
from a byte budget, or from a profiled forward on CUDA), the layer groups' layout, the block
manager, the scheduler over it, the workers' KV tensors, vLLM's maximum-concurrency startup
line; and `reconfigure_cache`, which rebuilds them on the same model."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from pagedserve.attention.kv_dtype import kv_cache_dtype
from pagedserve.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheManager, KVManagerConfig
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.recurrent_rules import (check_recurrent_state, has_recurrent_state,
                                               rebind_recurrent_state)
from pagedserve.worker.kv_cache import (
    bytes_per_block,
    kv_budget_from_profile,
    kv_layout,
    max_concurrency,
    num_blocks_for_budget,
    preemption_costs,
)
from pagedserve.worker.worker import CacheConfig, ProfileConfig

logger = logging.getLogger(__name__)


class CacheSetup:
    """Mixed into `LLMEngine` (which sets `executor`, `platform`, `source`, `dtype`, `args`,
    `max_model_len`, `eos_token_ids`, `kv_manager_factory`, `_seq_ids`, `_state_bound`)."""

    def _num_blocks(self, args: EngineArgs, spec, block_bytes: int, batched: int) -> int:
        """The KV block count: as given, else from `kv_cache_memory`, else (on CUDA) from what a
        profiled forward at the largest batch leaves of `gpu_memory_utilization`, else the CPU
        default budget."""
        if args.num_kv_blocks:
            return args.num_kv_blocks
        if args.kv_cache_memory or not self.platform.can_profile_memory:
            return num_blocks_for_budget(spec, args.block_size, self.kv_dtype,
                                         args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY,
                                         draft=self.executor.draft_kv_cache_spec,
                                         hybrid=self.kv_hybrid)
        self.kv_cache = None  # the old cache (reconfigure_cache) must not count as used
        profiles = self.executor.profile_memory(ProfileConfig(
            max_num_batched_tokens=batched, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, block_size=args.block_size))
        budget = min(kv_budget_from_profile(p.total, args.gpu_memory_utilization, p.peak,
                                            block_bytes) for p in profiles)
        blocks = num_blocks_for_budget(spec, args.block_size, self.kv_dtype, budget,
                                       draft=self.executor.draft_kv_cache_spec,
                                       hybrid=self.kv_hybrid)
        logger.info(
            "GPU KV cache: %d blocks of %d tokens (%.2f GiB per worker, gpu_memory_utilization="
            "%.2f, peak of the profiled step %.2f GiB)",
            blocks, args.block_size, budget / 2**30, args.gpu_memory_utilization,
            max(p.peak for p in profiles) / 2**30)
        return blocks

    def _build_cache(self, args: EngineArgs, one_group: bool = False) -> None:
        """The scheduler, block manager, KV tensors and runner for `args`' cache settings
        (`one_group`: every layer in one group of full attention)."""
        spec = self.executor.kv_cache_spec  # one worker's: the KV heads it holds
        # Layer groups with their own block tables (core/kv_spec.py), unless disabled; a draft
        # model's cache follows the target's tables block for block: one group then.
        self.kv_hybrid = (not args.disable_hybrid_kv_cache_manager and not one_group
                          and self.executor.draft_kv_cache_spec is None)
        if has_recurrent_state(spec):
            check_recurrent_state(self.source.name,
                                  draft_model=self.executor.draft_kv_cache_spec is not None,
                                  prefix_caching=args.enable_prefix_caching)
        self.kv_layout = kv_layout(spec, self.kv_hybrid)
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)  # (reconfigure_cache)
        block_bytes = bytes_per_block(spec, args.block_size, self.kv_dtype,
                                      draft=self.executor.draft_kv_cache_spec,
                                      hybrid=self.kv_hybrid)
        swap_s, recompute_s = preemption_costs(self.executor.num_params, block_bytes, self.platform)
        self.scheduler_config = args.scheduler_config(self.max_model_len, swap_s, recompute_s,
                                                      eos_token_ids=tuple(self.eos_token_ids))
        batched = self.scheduler_config.max_num_batched_tokens
        self.num_kv_blocks = self._num_blocks(args, spec, block_bytes, batched)
        num_cpu_blocks = 0
        if args.preemption_mode != "recompute":
            num_cpu_blocks = (
                args.num_cpu_blocks if args.num_cpu_blocks is not None
                else int(args.swap_space * 1024**3) // block_bytes
            )
        self.kv_manager = self.kv_manager_factory(KVManagerConfig(
            self.num_kv_blocks, args.block_size, num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=args.enable_prefix_caching, max_model_len=self.max_model_len,
            layout=self.kv_layout))
        if self.kv_hybrid and getattr(self.kv_manager, "layout", None) is None:
            # A manager that keeps one table of one group (a benchmark's baseline): so be it.
            return self._build_cache(args, one_group=True)
        # The manager may keep no swap pool (a benchmark baseline): the workers follow it.
        cpu_pool = self.kv_manager.cpu_pool
        self.num_cpu_blocks = cpu_pool.num_blocks if cpu_pool is not None else 0
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager,
                                   new_seq_id=lambda: next(self._seq_ids))
        self.executor.init_cache(CacheConfig(self.num_kv_blocks, args.block_size,
                                             self.num_cpu_blocks, tuple(self.eos_token_ids),
                                             max_num_seqs=args.max_num_seqs,
                                             max_model_len=self.max_model_len,
                                             hybrid=self.kv_hybrid, kv_dtype=self.kv_dtype))
        self.kv_cache = self.executor.kv_cache  # None when the cache lives in worker processes
        # vLLM's startup line: how many requests of max_model_len the cache holds at once
        chunk = batched if self.scheduler_config.enable_chunked_prefill else self.max_model_len
        self.max_concurrency = max_concurrency(self.num_kv_blocks, args.block_size,
                                               self.max_model_len, self.kv_layout, chunk)
        logger.info("KV cache: %s; %d blocks of %d tokens (%d bytes each). Maximum concurrency "
                    "for %d tokens per request: %.2fx", self.kv_layout.describe(),
                    self.num_kv_blocks, args.block_size, block_bytes, self.max_model_len,
                    self.max_concurrency)

    def reconfigure_cache(
        self, kv_manager_factory: Callable[[KVManagerConfig], KVCacheManager] | None = None,
        **changes,
    ) -> None:
        """Rebuild the KV cache and scheduler with other cache settings (block size, budgets,
        preemption mode, chunking) and KV manager (None: paging) on the same model. Only while no
        request is in flight; used by benchmarks that sweep cache settings without reloading the
        model."""
        if self.has_unfinished_requests():
            raise ValueError("reconfigure_cache needs an idle engine")
        args = dataclasses.replace(self.args, **changes)
        # NOTE: compared with what the workers' models are bound to, not with `self.args`: a
        # rebind stands even when the cache build below refuses the new settings
        wanted = (args.block_size, args.kv_cache_dtype)
        if has_recurrent_state(self.executor.kv_cache_spec) and wanted != self._state_bound:
            rebind_recurrent_state(self.executor, args.block_size,
                                   kv_cache_dtype(args.kv_cache_dtype, self.dtype))
            self._state_bound = wanted
        self.kv_manager_factory = kv_manager_factory or KVCacheManager.from_config
        self._build_cache(args)
        self.args = args
