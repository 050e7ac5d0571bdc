"""One tensor-parallel rank: its model shard, the KV cache of its heads, and a model runner fed
by step messages. The multiprocessing and Ray executors each host one `Worker` per rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedserve.distributed.process_group import destroy_tp_group, init_tp_group
from pagedserve.models.base import KVCacheSpec
from pagedserve.models.loader import load_model
from pagedserve.models.source import ModelSource
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.model_runner import ModelRunner, SeqStepOutput
from pagedserve.worker.step_message import StepDecoder, StepMessage


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs to build its shard. Picklable: it crosses process boundaries."""

    source: ModelSource
    load_format: str
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    seed: int
    world_size: int
    # torch threads per worker on CPU (the driver's threads shared among the workers); None: as is
    num_threads: int | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the driver sizes the KV cache from: one worker's KV spec and parameter count."""

    kv_cache_spec: KVCacheSpec
    num_params: int


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache every worker allocates (the same block count on all: one set of tables)."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    stop_token_ids: tuple[int, ...]  # EOS ids masked while a request is below min_tokens


@dataclass
class StepReply:
    """A worker's answer to a step: rank 0's outputs (None on other ranks) and its busy time."""

    outputs: list[SeqStepOutput] | None
    seconds: float


def model_info(model: torch.nn.Module) -> ModelInfo:
    return ModelInfo(model.kv_cache_spec, sum(p.numel() for p in model.parameters()))


class Worker:
    """Rank `rank` of `config.world_size`: joins the process group at `init_method`, builds and
    loads its shard (reading only its part of each safetensors tensor), then runs steps."""

    def __init__(self, config: WorkerConfig, rank: int, init_method: str, device_index: int = 0):
        self.rank = rank
        self.dtype = config.dtype
        if config.device_type == "cuda":
            self.device = torch.device("cuda", device_index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        self.tp = init_tp_group(rank, config.world_size, init_method, self.device)
        source = config.source
        weights = None if config.load_format == "dummy" else source.iter_weights(
            lazy=config.world_size > 1)
        self.model = load_model(source.config, weights=weights, dtype=config.dtype,
                                device=self.device, seed=config.seed, tp=self.tp)
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.decoder = StepDecoder()

    def info(self) -> ModelInfo:
        return model_info(self.model)

    def init_cache(self, cache: CacheConfig) -> None:
        """(Re)allocate the KV cache of this rank's heads; forget every request."""
        self.runner = self.kv_cache = None  # free the old tensors before allocating new ones
        self.kv_cache = KVCache(self.model.kv_cache_spec, cache.num_blocks, cache.block_size,
                                self.dtype, self.device,
                                num_cpu_blocks=cache.num_cpu_blocks)
        self.runner = ModelRunner(self.model, self.kv_cache, device=self.device,
                                  stop_token_ids_for_min_tokens=list(cache.stop_token_ids),
                                  sample=self.rank == 0)
        self.decoder.reset()

    def execute(self, msg: StepMessage) -> StepReply:
        """Run one step on this shard; rank 0 returns the sampled outputs."""
        start = time.perf_counter()
        outputs = self.runner.execute(self.decoder.decode(msg))
        return StepReply(outputs if self.rank == 0 else None, time.perf_counter() - start)

    def close(self) -> None:
        destroy_tp_group(self.tp)
