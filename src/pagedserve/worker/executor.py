"""Executors: how the engine's one scheduler drives the model workers.

The engine calls `executor.execute(StepInput) -> list[SeqStepOutput]` every step, whatever the
backend (`EngineArgs.distributed_executor_backend`); every backend runs the same `Worker`, and
every one speaks the same step protocol: the driver's `StepEncoder` packs the scheduler's delta
(`core.step_delta.StepDelta`) and the rows into a `StepMessage`, the worker's `StepDecoder`
applies it to its persistent per-request batch (`worker.step_message`):

- "uni" (`UniExecutor`): one `Worker` in this process, handed the message directly: no
  serialization, no process (tensor_parallel_size = 1).
- "mp" (`worker.mp_executor.MultiprocExecutor`): one spawned process per tensor-parallel rank on
  this machine; each step travels as a `StepMessage` delta.
- "ray" (`worker.ray_executor.RayExecutor`): one Ray actor per rank, across machines.

The base class and what every backend shares are in worker/executor_base.py.
"""

from __future__ import annotations

import torch

from pagedserve.core.step_input import StepInput
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.models.source import ModelSource
from pagedserve.platforms import platform_for
from pagedserve.worker.executor_base import (  # noqa: F401 (re-exported)
    CommStats,
    Executor,
    WorkerDiedError,
)
from pagedserve.worker.model_runner import MemoryProfile, ModelRunner
from pagedserve.worker.step_message import StepEncoder
from pagedserve.worker.worker import CacheConfig, ProfileConfig, Worker, WorkerConfig


class UniExecutor(Executor):
    """One `Worker` (rank 0 of 1) in this process; `execute` encodes the step as the other
    executors do (`StepEncoder`) and hands the message to the worker, unpickled.

    NOTE: the worker's decoder is reset with the KV cache (`init_cache`, `free_cache`), as the
    multi-process executors' are; the encoder holds no state (the scheduler's delta says what
    the workers hold)."""

    def __init__(self, config: WorkerConfig, device: torch.device) -> None:
        super().__init__()
        self.encoder = StepEncoder()
        self.worker = Worker(config, device_index=device.index or 0)
        self.model = self.worker.model
        info = self.worker.info()
        self.kv_cache_spec, self.num_params = info.kv_cache_spec, info.num_params
        self.draft_kv_cache_spec = info.draft_kv_cache_spec

    @property
    def runner(self) -> ModelRunner | None:
        return self.worker.runner

    def init_cache(self, cache: CacheConfig) -> None:
        self.kv_cache = None
        self.worker.init_cache(cache)  # resets the worker's decoder
        self.kv_cache = self.worker.kv_cache

    def profile_memory(self, prof: ProfileConfig) -> list[MemoryProfile]:
        self.kv_cache = None
        return [self.worker.profile_memory(prof)]

    def execute(self, step: StepInput) -> list[SeqStepOutput]:
        reply = self.worker.execute(self.encoder.encode(step))
        self.draft_seconds += reply.draft_seconds
        return reply.outputs

    def free_cache(self) -> None:
        self.kv_cache = None
        self.worker.free_cache()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return [self.worker.rpc(method, args, kwargs or {})]


def executor_backend(tensor_parallel_size: int, backend: str | None) -> str:
    """The backend to use: as given (`EngineArgs` validated it), else "uni" for one worker and
    "mp" for more."""
    if backend is None:
        return "uni" if tensor_parallel_size == 1 else "mp"
    return backend


def check_shardable(config, world_size: int) -> None:
    """ValueError (before any worker starts) unless the model splits over `world_size` ranks:
    the model is built on the meta device, which allocates nothing."""
    from pagedserve.distributed.tp import TPContext
    from pagedserve.models.registry import get_model_class

    model_class = get_model_class(config)
    with torch.device("meta"):
        for rank in range(world_size):
            model_class(config, tp=TPContext(rank, world_size))


def make_executor(args, source: ModelSource, dtype: torch.dtype, device: torch.device,
                  draft: ModelSource | None = None) -> Executor:
    """The executor `args` (an `EngineArgs`) asks for, with its workers started and the model
    loaded: `args.tensor_parallel_size` ranks on `args.distributed_executor_backend`; `draft`:
    a draft model for speculative decoding, loaded beside it."""
    world_size = args.tensor_parallel_size
    backend = executor_backend(world_size, args.distributed_executor_backend)
    cpu_threads = getattr(args, "cpu_threads", None) or torch.get_num_threads()
    cpu_bind: tuple[int, ...] = ()
    platform = platform_for(device)
    if platform.shares_host_threads and getattr(args, "cpu_threads_bind", None):
        from pagedserve.config import parse_cpu_list

        cpu_bind = tuple(parse_cpu_list(args.cpu_threads_bind, limit=getattr(args, "cpu_threads", None)))
        cpu_threads = len(cpu_bind)
    threads = platform.threads_per_worker(cpu_threads, world_size)
    from pagedserve.attention.kv_dtype import kv_cache_dtype
    from pagedserve.layers.hf_quant import checkpoint_method
    from pagedserve.layers.quantization import resolve_gguf_activations, resolve_quantization

    quantization = resolve_quantization(getattr(args, "quantization", None), source.kind, device.type,
                                        world_size, checkpoint_method(source.config))
    if args.load_format == "dummy" and quantization == "gguf":
        quantization = "none"  # random weights: nothing to keep
    if getattr(args, "enable_expert_parallel", False) and world_size > 1:
        import copy
        import dataclasses

        # the MoE models read it from their config (models.mixtral.MoECausalLM)
        model_config = copy.deepcopy(source.config)
        model_config.enable_expert_parallel = True
        source = dataclasses.replace(source, config=model_config)
    config = WorkerConfig(source=source, load_format=args.load_format, dtype=dtype,
                          device_type=device.type, seed=args.seed, world_size=world_size,
                          num_threads=threads, attention_backend=args.attention_backend,
                          enforce_eager=args.enforce_eager, quantization=quantization,
                          batch_invariant=bool(getattr(args, "batch_invariant", False)),
                          int8_activations=resolve_gguf_activations(
                              getattr(args, "gguf_activations", "auto"),
                              getattr(source, "gguf_activations", None)),
                          cpu_bind=cpu_bind, lora=getattr(args, "lora_config", lambda: None)(),
                          draft=draft, max_model_len=getattr(args, "max_model_len", None),
                          kv_block_size=getattr(args, "block_size", 16),
                          kv_dtype=kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"), dtype))
    num_stages = getattr(args, "pipeline_parallel_size", 1)
    if num_stages > 1:  # pipeline stages as Ray actors (worker/pp_executor.py)
        import dataclasses

        from pagedserve.worker.pp_executor import PipelineExecutor

        if platform.shares_host_threads:  # the CPUs shared among the stages
            config = dataclasses.replace(
                config, num_threads=platform.threads_per_worker(cpu_threads, num_stages))
        return PipelineExecutor(config, num_stages, args.ray_address)
    if backend == "uni":
        return UniExecutor(config, device)
    check_shardable(source.config, world_size)
    if backend == "mp":
        from pagedserve.worker.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedserve.worker.ray_executor import RayExecutor

    return RayExecutor(config, args.ray_address)
