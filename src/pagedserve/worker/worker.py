"""One tensor-parallel rank: its model shard, the KV cache of its heads, and a model runner fed
by step messages. The multiprocessing and Ray executors each host one `Worker` per rank."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from pagedserve.distributed.process_group import destroy_tp_group, init_tp_group
from pagedserve.models.base import KVCacheSpec
from pagedserve.models.loader import load_model
from pagedserve.models.source import ModelSource
from pagedserve.platforms import Platform, platform_for
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.model_runner import MemoryProfile, ModelRunner, profile_forward
from pagedserve.core.step_input import StepInput
from pagedserve.core.step_output import SeqStepOutput
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
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    enforce_eager: bool = False  # no CUDA graphs
    quantization: str = "none"  # one of layers.quantization.QUANTIZATIONS (resolve_quantization)
    batch_invariant: bool = False  # quantized products on one kernel for every row count
    # GGUF blocks times 8-bit x (llama.cpp's numerics), or x as it is (EngineArgs.gguf_activations)
    int8_activations: bool = True
    # CPUs the compute threads are pinned to (EngineArgs.cpu_threads_bind), split evenly over the
    # ranks; () leaves them to the OS
    cpu_bind: tuple[int, ...] = ()
    # multi-LoRA serving (EngineArgs.enable_lora): the slot table's limits; None: no adapters
    lora: object | None = None  # lora.request.LoRAConfig
    # speculative decoding with a draft model (speculative_config.model): its source, loaded
    # beside the model (same dtype, unsharded), with its own KV cache of the same block layout
    draft: ModelSource | None = None
    # the longest context served (EngineArgs.max_model_len; None: the model's limit): LongRoPE
    # picks its factors by it (layers.rotary.RotaryEmbedding.set_max_model_len)
    max_model_len: int | None = None
    # the KV blocks' tokens and storage dtype (None: `dtype`), known at load: a recurrent
    # layer's state takes cache entries by them (PagedCausalLM.bind_cache)
    kv_block_size: int = 16
    kv_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the driver sizes the KV cache from: one worker's KV spec and parameter count."""

    kv_cache_spec: KVCacheSpec
    num_params: int
    # the draft model's KV spec (speculative decoding with a draft model), else None: each block
    # holds its K/V too (worker/spec_draft.py)
    draft_kv_cache_spec: KVCacheSpec | None = None


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache every worker allocates (the same block count on all: one set of tables)."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    stop_token_ids: tuple[int, ...]  # EOS ids masked while a request is below min_tokens
    # The scheduler's limits, for the CUDA graphs' buckets and block-table width.
    max_num_seqs: int = 256
    max_model_len: int = 2048
    # Layer groups of their own block tables (sliding-window, full, latent attention: the
    # driver's `KVLayout`); False: one group of full attention (core/kv_spec.py)
    hybrid: bool = True
    # the blocks' storage dtype (fp8 with EngineArgs.kv_cache_dtype: attention/kv_dtype.py);
    # None: the model's dtype
    kv_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ProfileConfig:
    """The largest step the scheduler can form, for GPU memory profiling."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int


@dataclass
class StepReply:
    """A worker's answer to a step: rank 0's outputs (None on other ranks) and its busy time."""

    outputs: list[SeqStepOutput] | None
    seconds: float
    draft_seconds: float = 0.0  # of `seconds`, the draft model's (speculative decoding)


def model_info(model: torch.nn.Module, draft: torch.nn.Module | None = None) -> ModelInfo:
    return ModelInfo(model.kv_cache_spec, sum(_num_values(p) for p in model.parameters()),
                     draft.kv_cache_spec if draft is not None else None)


def _num_values(p: torch.Tensor) -> int:
    """Parameters a tensor holds: a quantized weight's rows times its input features."""
    spec = getattr(p, "quant", None)  # kernels.cpu_qlinear.QuantSpec
    return p.shape[0] * spec.in_features if spec is not None else p.numel()


def make_runner(model, kv_cache: KVCache, cache: CacheConfig, platform: Platform, *,
                attention_backend: str, enforce_eager: bool, sample: bool = True,
                lora=None, drafter=None) -> ModelRunner:
    """The runner of one worker over its freshly allocated KV cache (CUDA graphs captured here
    where the platform has them, unless `enforce_eager`)."""
    return ModelRunner(model, kv_cache, device=platform.device,
                       stop_token_ids_for_min_tokens=list(cache.stop_token_ids), sample=sample,
                       attention_backend=attention_backend, cuda_graphs=not enforce_eager,
                       max_num_seqs=cache.max_num_seqs, max_model_len=cache.max_model_len,
                       platform=platform, lora=lora, drafter=drafter)


def profile_memory(model, dtype: torch.dtype, platform: Platform, attention_backend: str,
                   prof: ProfileConfig) -> MemoryProfile:
    """Peak memory of the largest step on this worker (a platform that profiles: CUDA): the
    worker runs the step (`profile_forward` over a one-block scratch cache), the platform
    measures it."""
    backend = platform.attention_backend(attention_backend)

    def largest_step() -> None:
        scratch = KVCache(model.kv_cache_spec, 1, prof.block_size, dtype, platform.device,
                          platform=platform)
        profile_forward(model, scratch, device=platform.device, backend=backend,
                        max_num_batched_tokens=prof.max_num_batched_tokens,
                        max_num_seqs=prof.max_num_seqs, max_model_len=prof.max_model_len)

    total, peak = platform.measure_peak_memory(largest_step)
    return MemoryProfile(total=total, peak=peak)


class Worker:
    """Rank `rank` of `config.world_size`: joins the process group at `init_method`, builds and
    loads its shard (reading only its part of each safetensors tensor), then runs steps."""

    def __init__(self, config: WorkerConfig, rank: int = 0, init_method: str = "",
                 device_index: int = 0):
        self.rank = rank
        self.dtype = config.dtype
        # NOTE: the one place a worker looks at its device type: everything device-specific
        # below asks this platform.
        self.platform = platform_for(config.device_type)
        self.device = self.platform.worker_device(device_index, config.num_threads)
        share = len(config.cpu_bind) // config.world_size
        self._cpu_bind = list(config.cpu_bind[rank * share:(rank + 1) * share])
        self._bound_thread: int | None = None  # the thread whose OpenMP team is pinned
        self.tp = init_tp_group(rank, config.world_size, init_method, self.device)
        source = config.source
        weights = None if config.load_format == "dummy" else source.iter_weights(
            lazy=config.world_size > 1, keep_quantized=config.quantization == "gguf")
        if weights is not None:  # an HF checkpoint's packed layers (layers.hf_quant), kept or dequantized
            from pagedserve.layers.hf_quant import HF_QUANTIZATIONS, checkpoint_method, hf_quantized_weights

            method = checkpoint_method(source.config) if source.kind == "hf" else None
            if method in HF_QUANTIZATIONS:
                weights = hf_quantized_weights(weights, source.config, method,
                                               keep=config.quantization == method)
        self.model = load_model(source.config, weights=weights, dtype=config.dtype,
                                device=self.device, seed=config.seed, tp=self.tp,
                                quantization=config.quantization,
                                batch_invariant=config.batch_invariant, platform=self.platform,
                                max_model_len=config.max_model_len,
                                int8_activations=config.int8_activations)
        if hasattr(self.model, "bind_cache"):
            self.model.bind_cache(config.kv_block_size, config.kv_dtype or config.dtype)
        self.lora = None  # lora.slots.LoRASlots: this rank's adapters (hooks on its model)
        if config.lora is not None:
            from pagedserve.lora.slots import LoRASlots

            self.lora = LoRASlots(self.model, config.lora, config.dtype, self.device)
        self.draft_model = None  # speculative decoding's draft model (worker/spec_draft.py)
        if config.draft is not None:
            if config.world_size > 1:
                raise ValueError("speculative_config.model: a draft model runs with "
                                 "tensor_parallel_size=1 only")
            draft = config.draft
            # a GGUF draft keeps its quantized blocks where the target's GGUF does
            quant = "gguf" if draft.kind == "gguf" and config.quantization == "gguf" else "none"
            self.draft_model = load_model(
                draft.config, weights=None if config.load_format == "dummy"
                else draft.iter_weights(lazy=False, keep_quantized=quant == "gguf"),
                dtype=config.dtype, device=self.device, seed=config.seed + 1, tp=self.tp,
                quantization=quant, batch_invariant=config.batch_invariant,
                platform=self.platform)
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.decoder = StepDecoder()
        self.attention_backend = config.attention_backend
        self.enforce_eager = config.enforce_eager

    def info(self) -> ModelInfo:
        return model_info(self.model, self.draft_model)

    def init_cache(self, cache: CacheConfig) -> None:
        """(Re)allocate the KV cache of this rank's heads; forget every request."""
        self.runner = self.kv_cache = None  # free the old tensors before allocating new ones
        kv_dtype = cache.kv_dtype or self.dtype
        self.kv_cache = KVCache(self.model.kv_cache_spec, cache.num_blocks, cache.block_size,
                                kv_dtype, self.device,
                                num_cpu_blocks=cache.num_cpu_blocks, platform=self.platform,
                                hybrid=cache.hybrid)
        drafter = None
        if self.draft_model is not None:
            from pagedserve.worker.spec_draft import DraftProposer

            # the same block layout as the target's: the same tables index both
            draft_cache = KVCache(self.draft_model.kv_cache_spec, cache.num_blocks,
                                  cache.block_size, kv_dtype, self.device,
                                  num_cpu_blocks=cache.num_cpu_blocks, platform=self.platform,
                                  hybrid=False)
            drafter = DraftProposer(self.draft_model, draft_cache,
                                    self.platform.attention_backend(self.attention_backend),
                                    self.device)
        self.runner = make_runner(self.model, self.kv_cache, cache, self.platform,
                                  attention_backend=self.attention_backend,
                                  enforce_eager=self.enforce_eager, sample=self.rank == 0,
                                  lora=self.lora, drafter=drafter)
        self.decoder.reset()

    def free_cache(self) -> None:
        """Drop the KV cache and its runner (`init_cache` builds them again); on CUDA the
        allocator's cached blocks go back to the device too."""
        self.runner = self.kv_cache = None
        self.decoder.reset()
        self.platform.empty_cache()

    def bind_cache(self, block_size: int, kv_dtype: torch.dtype):
        """Refit the model's cache entries (a recurrent state's, `PagedCausalLM.bind_cache`) to
        blocks of `block_size` tokens in `kv_dtype`; returns its new KV spec. Only between
        caches: `init_cache` allocates the next one."""
        self.runner = self.kv_cache = None
        self.model.bind_cache(block_size, kv_dtype)
        return self.model.kv_cache_spec

    def rpc(self, method, args: tuple, kwargs: dict):
        """`collective_rpc` on this rank: `self.<method>(*args, **kwargs)` for a name, else
        `method(self, *args, **kwargs)`."""
        if isinstance(method, str):
            return getattr(self, method)(*args, **kwargs)
        return method(self, *args, **kwargs)

    def profile_memory(self, prof: ProfileConfig) -> MemoryProfile:
        """Free the KV cache, then profile the largest step (CUDA only)."""
        self.runner = self.kv_cache = None
        return profile_memory(self.model, self.dtype, self.platform, self.attention_backend, prof)

    def execute(self, msg: StepMessage) -> StepReply:
        """Run one step, sent as a delta message, on this shard; rank 0 returns the outputs."""
        start = time.perf_counter()
        drafter = self.runner.drafter if self.runner is not None else None
        drafted = drafter.seconds if drafter is not None else 0.0
        outputs = self.execute_step(self.decoder.decode(msg))
        return StepReply(outputs if self.rank == 0 else None, time.perf_counter() - start,
                         drafter.seconds - drafted if drafter is not None else 0.0)

    def execute_step(self, step: StepInput) -> list[SeqStepOutput]:
        """Run one step on this shard: one output per row on rank 0 ([] on the others)."""
        if self._cpu_bind and self._bound_thread != threading.get_ident():
            # NOTE: OpenMP teams are per thread: pin the team of the thread that steps (the
            # server's engine thread is not the one that loaded the model)
            from pagedserve.kernels.openmp import bind_compute_threads

            bind_compute_threads(self._cpu_bind)
            self._bound_thread = threading.get_ident()
        return self.runner.execute(step)

    def close(self) -> None:
        destroy_tp_group(self.tp)
