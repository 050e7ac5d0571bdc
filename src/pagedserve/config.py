"""Engine options: one dataclass built from the CLI or the Python API, validated with ValueError."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedserve.core.contiguous import KV_ALLOCATORS

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("none", "gguf", "int8")  # as layers.quantization.QUANTIZATIONS (no torch here)


@dataclass
class EngineArgs:
    """Everything that configures an engine. Names follow vLLM's where vLLM has them.

    `model=None` runs the embedded Gemma 3 270M. `kv_cache_memory` is the KV budget in bytes
    (default 2 GiB on CPU); `num_kv_blocks` overrides it with an exact block count. Preempted
    requests are recovered by `preemption_mode` ("recompute" | "swap" | "auto") through a CPU
    swap pool of `swap_space` GiB (`num_cpu_blocks` overrides it).

    `tensor_parallel_size` workers each hold a shard of every layer and the KV cache of their
    heads (the KV budgets are per worker), run by `distributed_executor_backend`: "uni" (in this
    process; one worker), "mp" (worker processes on this machine) or "ray" (Ray actors on the
    cluster at `ray_address`, else a local Ray); None picks "uni" for one worker, "mp" for more.

    `kv_allocator` is "paged" (the only mode for production use) or, for measuring paging against
    Orca-style baselines only, "contiguous-max" | "contiguous-pow2" | "contiguous-oracle": one
    contiguous reservation per request at admission (see `core.contiguous`); these run without
    prefix caching, swapping, parallel sampling or beam search.

    On CUDA, when neither `kv_cache_memory` nor `num_kv_blocks` is given, the KV cache gets what a
    profiled forward pass at the largest batch leaves of `gpu_memory_utilization` of the device's
    memory. Decode-only steps replay CUDA graphs unless `enforce_eager`. `attention_backend` is
    "auto" (Triton on CUDA when importable, else the torch reference), "torch" or "triton".
    `skip_tokenizer_init` loads no tokenizer: prompts must be token ids, outputs carry no text.
    `quantization` (CPU, one worker): None keeps a GGUF file's quantized weights as they are
    (otherwise "none"); "none" dequantizes them to `dtype`; "gguf" requires that they stay;
    "int8" quantizes every linear layer and embedding to INT8 per output channel at load. `dtype`
    stays the activation and KV cache dtype.
    """

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    swap_space: float = 4.0
    num_cpu_blocks: int | None = None
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None
    kv_allocator: str = "paged"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    attention_backend: str = "auto"
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    # Testing aid: randomise the order of the free block list (outputs must not change).
    shuffle_free_blocks_seed: int | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        for name in ("kv_cache_memory", "num_kv_blocks", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(
                f"preemption_mode must be 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}"
            )
        if not (self.swap_space >= 0 and self.swap_space < float("inf")):
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.kv_allocator not in KV_ALLOCATORS:
            raise ValueError(f"kv_allocator must be one of {KV_ALLOCATORS}, got {self.kv_allocator!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not (
                isinstance(self.gpu_memory_utilization, (int, float))
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker in this process; "
                             f"tensor_parallel_size={self.tensor_parallel_size} needs 'mp' or 'ray'")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
