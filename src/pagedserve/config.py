"""Engine options: one dataclass, the single source of truth for the Python API and the CLI.

Each `EngineArgs` field carries its help text (and, where the values are a fixed list, the
constant naming them) in its metadata; `entrypoints/cli.py` turns every field into a flag of
`generate`, `serve` and the `bench` commands, so a new field is a new flag. Values are validated
once, here, with ValueError.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from pagedserve.attention.backends import BACKEND_CHOICES
from pagedserve.core.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from pagedserve.core.spec_decode import SpeculativeConfig
from pagedserve.json_option import json_object as _json_object
from pagedserve.pooling_params import RUNNERS, PoolerConfig
from pagedserve.reasoning import REASONING_PARSERS  # the registry's names (no parser imported)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")  # vLLM's: half, float
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
CONVERTS = ("auto", "none", "embed", "classify")
DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N"
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
ATTENTION_BACKENDS = BACKEND_CHOICES  # owned by the attention layer's (torch-free) registry
# as layers.quantization.QUANTIZATIONS (no torch here; tests/models/test_hf_quant.py checks)
QUANTIZATIONS = ("none", "gguf", "int8", "awq", "gptq", "compressed-tensors", "fp8")
GGUF_ACTIVATIONS = ("auto", "int8", "dtype")  # as layers.quantization.GGUF_ACTIVATIONS
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
DATA_PARALLEL_BACKENDS = ("mp", "ray")
DATA_PARALLEL_ROUTINGS = ("prefix", "least-load", "round-robin")  # as engine.dp_router's


def parse_cpu_list(spec: str, limit: int | None = None) -> list[int]:
    """CPU ids from `spec`: "auto" (the CPUs this process may run on, in order) or a list such as
    "0-3,6" (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax); the first `limit` of them when given.
    ValueError naming `cpu_threads_bind` for anything else, or a CPU this process may not use."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if spec.strip().lower() == "auto":
        cpus = allowed
    else:
        cpus = []
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            try:
                first, last = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ValueError(f"cpu_threads_bind: {spec!r} is not 'auto' or a CPU list such as "
                                 "'0-3,6'") from None
            if first < 0 or last < first:
                raise ValueError(f"cpu_threads_bind: bad CPU range {part.strip()!r} in {spec!r}")
            cpus.extend(range(first, last + 1))
        if len(set(cpus)) != len(cpus):
            raise ValueError(f"cpu_threads_bind: {spec!r} names a CPU twice")
        missing = sorted(set(cpus) - set(allowed)) if allowed else []
        if missing:
            raise ValueError(f"cpu_threads_bind: CPU {missing[0]} is not one this process may use "
                             f"(allowed: {allowed})")
    if not cpus:
        raise ValueError(f"cpu_threads_bind: {spec!r} names no CPU")
    return cpus[:limit] if limit else cpus


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           aliases: tuple[str, ...] = ()) -> Field:
    """A documented `EngineArgs` field: its default, the help of its CLI flag, the allowed values
    (`choices`, validated in `EngineArgs.__post_init__`) and extra flag spellings (`aliases`)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


def human_int(value: str) -> int:
    """An integer flag's value, as vLLM reads them: plain ("4096"), or with a suffix -- k, m, g, t
    powers of 1000, K, M, G, T powers of 1024 ("32k" = 32000, "4G" = 4 * 2**30, "1.5K" = 1536)."""
    text = value.strip()
    powers = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
              "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    scale = powers.get(text[-1:], 1) if text else 1
    number = text[:-1] if scale != 1 else text
    try:
        result = float(number) * scale if scale != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k or 4G, got "
                                         f"{value!r}") from None
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(result)


def _flag_type(annotation: Any) -> type:
    """The type of a field annotated `T` or `T | None` (a string: postponed annotations)."""
    name = str(annotation).replace(" ", "").removesuffix("|None")
    types = {"str": str, "int": human_int, "float": float, "bool": bool}
    if name not in types:
        raise TypeError(f"EngineArgs field of type {annotation!r}: no CLI flag type for it")
    return types[name]


@dataclass
class EngineArgs:
    """Everything that configures an engine. Names follow vLLM's where vLLM has them; every
    field's meaning is its `help` (also `pagedserve serve --help`).

    Preempted requests are recovered by `preemption_mode` through a CPU swap pool of `swap_space`
    GiB. `tensor_parallel_size` workers each hold a shard of every layer and the KV cache of
    their heads (the KV budgets are per worker). On CUDA, when neither `kv_cache_memory` nor
    `num_kv_blocks` is given, the KV cache gets what a profiled forward pass at the largest batch
    leaves of `gpu_memory_utilization` of the device's memory.
    """

    model: str | None = option(
        None, "HF folder, GGUF file or hub id (default: the embedded Gemma 3 270M)")
    tokenizer: str | None = option(None, "tokenizer folder or hub id (default: the model's)")
    load_format: str = option("auto", "how to read the weights (dummy: random, for benchmarks)",
                              choices=LOAD_FORMATS)
    dtype: str = option("auto", "weight, activation and KV dtype (auto: bfloat16 on CPUs with "
                        "native BF16, else float32; the checkpoint's on GPUs; vLLM's half = "
                        "float16, float = float32)", choices=DTYPES)
    kv_cache_dtype: str = option(
        "auto", "KV cache storage dtype: auto (the model's dtype); fp8 (= fp8_e4m3, vLLM's "
        "default fp8) or fp8_e5m2: one byte per value, half a bf16 cache's memory per token "
        "(twice the tokens in the same budget), converted back in the attention kernels; scale "
        "1.0, saturated to the format's range (CPU)", choices=KV_CACHE_DTYPES)
    trust_remote_code: bool = option(
        False, "accepted for vLLM's command lines: pagedserve never runs code from a model's "
        "files (its own model classes only), with or without it; the log says so")
    revision: str | None = option(None, "the hub revision (branch, tag or commit) of a hub model "
                                        "(no effect on a local folder or file)")
    tokenizer_revision: str | None = option(None, "the hub revision of a hub tokenizer")
    download_dir: str | None = option(None, "where hub models are downloaded (default: the HF "
                                            "cache)")
    hf_overrides: str | None = option(
        None, "fields set over the model's HF config, a JSON object (vLLM's), e.g. "
        "'{\"rope_theta\": 20000}' (from Python also a dict); nested objects update sub-configs")
    convert: str = option(
        "auto", "vLLM's model conversion: embed serves a generative model's last hidden state as "
        "embeddings (--runner pooling); classify needs a *ForSequenceClassification checkpoint "
        "here; auto / none: as the checkpoint is", choices=CONVERTS)
    quantization: str | None = option(
        None, "CPU weights: none (dequantize to --dtype), gguf (keep a GGUF file's quantized "
        "tensors; the default for GGUF files on CPU with one worker) or int8 (weight-only, "
        "per-channel, computed at load); awq / gptq / compressed-tensors / fp8 (an HF checkpoint's "
        "packed weights kept as stored; the default for such checkpoints)", choices=QUANTIZATIONS,
        aliases=("-q",))
    gguf_activations: str = option(
        "auto", "products over kept GGUF blocks (--quantization gguf): int8 quantizes x to 8-bit "
        "blocks (llama.cpp's numerics, the fastest), dtype multiplies x as it is with the blocks "
        "dequantized tile by tile (what the dequantized checkpoint computes); auto: the model's "
        "recommendation (dtype for the default SmolLM2), else int8", choices=GGUF_ACTIVATIONS)
    device: str = option("auto", "auto, cpu, cuda or cuda:N (auto: cuda when available)")
    seed: int = option(0, "seed of the engine's random state")
    block_size: int = option(16, "tokens per KV block (1-256)")
    kv_cache_memory: int | None = option(
        None, f"KV cache budget in bytes, e.g. 4G (default {DEFAULT_CPU_KV_CACHE_MEMORY >> 30} GiB "
        "on CPU, or $VLLM_CPU_KVCACHE_SPACE GiB when set, as vLLM's CPU backend; on CUDA what a "
        "profiled step leaves)", aliases=("--kv-cache-memory-bytes",))
    num_kv_blocks: int | None = option(None, "exact number of KV blocks (overrides the budget)",
                                       aliases=("--num-gpu-blocks-override",))
    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = option(
        None, "most tokens in one step (default 2048 with chunked prefill, else max(max_model_len,"
        " 2048))")
    max_model_len: int | None = option(
        None, "longest prompt + output (default: the model's max_position_embeddings)")
    enable_chunked_prefill: bool = option(True, "split long prompts over steps")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = option(
        False, "keep every layer's KV blocks for the whole sequence (one group of full "
        "attention), not a block table per layer group with sliding-window layers giving back "
        "the blocks their window left (vLLM's flag); a draft model for speculation implies it")
    preemption_mode: str = option(
        "auto", "how preempted requests come back: recompute, swap (to the CPU pool) or auto "
        "(the cheaper of the two)", choices=PREEMPTION_MODES)
    swap_space: float = option(4.0, "CPU swap pool in GiB")
    num_cpu_blocks: int | None = option(None, "exact number of CPU swap blocks (overrides "
                                              "swap_space)")
    max_logprobs: int = option(20, "most logprobs a request may ask for")
    tensor_parallel_size: int = option(
        1, "workers sharing every layer (Megatron-style tensor parallelism)", aliases=("-tp",))
    enable_expert_parallel: bool = option(
        False, "mixture-of-experts models: whole experts split across the tensor-parallel ranks "
        "(each rank holds num_experts / tensor_parallel_size of them) instead of every expert "
        "sharded along its intermediate dimension; attention stays tensor-parallel",
        aliases=("-ep",))
    distributed_executor_backend: str | None = option(
        None, "uni: in this process; mp: worker processes on this machine; ray: Ray actors "
        "(default: uni for one worker, mp for more)", choices=EXECUTOR_BACKENDS)
    ray_address: str | None = option(
        None, "Ray cluster to join with the ray backend (default: a Ray instance running on "
        "this machine, else a new local one)")
    gpu_memory_utilization: float = option(
        0.9, "share of the GPU's memory for weights, activations and the KV cache (CUDA; the KV "
        "cache gets what a profiled step leaves)", aliases=("--device-memory-utilization",))
    enforce_eager: bool = option(False, "no CUDA graphs: run every step eagerly")
    attention_backend: str = option(
        "auto", "auto: triton on CUDA when available, else torch", choices=ATTENTION_BACKENDS)
    skip_tokenizer_init: bool = option(
        False, "load no tokenizer: prompts must be token ids, outputs carry no text")
    batch_invariant: bool = option(
        False, "CPU products over GGUF blocks always on the 8-bit-activation kernel, so that a "
        "request's tokens and logprobs never depend on the batch it runs in (bf16; float32 is "
        "always batch-invariant); off: the fastest kernel per row count (a blocked bf16 GEMM "
        "from ~12 rows on)")
    cpu_threads: int | None = option(
        None, "compute threads on CPU (default: torch's, one per core; vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND in spirit: see docs/benchmarks.md on threads)")
    cpu_threads_bind: str | None = option(
        None, "pin the compute threads to CPUs: auto (one per CPU this process may use, in "
        "order, up to --cpu-threads) or a list such as 0-3,6 (vLLM's VLLM_CPU_OMP_THREADS_BIND, "
        "also read: its ranks' lists joined, nobind: none); default: the OS places them")
    structured_outputs_disable_any_whitespace: bool = option(
        False, "structured JSON outputs without free whitespace between tokens (vLLM's "
        "structured_outputs_config.disable_any_whitespace; a request can also ask for it)")
    reasoning_parser: str | None = option(
        None, "the model's reasoning format: structured outputs apply only after its reasoning "
        "ends, and the server returns the reasoning apart from the content (vLLM's "
        "--reasoning-parser)", choices=REASONING_PARSERS)
    require_kernels: bool = option(
        False, "fail at start-up if the compiled CPU kernels cannot load, instead of warning and "
        "running the much slower torch fallback")
    runner: str = option(
        "auto", "generate (text generation) or pooling (embeddings, classification, scores: "
        "LLM.embed / /v1/embeddings); auto: pooling for a checkpoint without an LM head (a bare "
        "*Model or a *ForSequenceClassification), else generate",
        choices=RUNNERS)
    pooler_config: str | None = option(
        None, "the pooling runner's pooler as JSON, e.g. '{\"pooling_type\": \"MEAN\", "
        "\"normalize\": true}' (pooling_type LAST | MEAN | CLS; default: the model's "
        "sentence-transformers files, else LAST, normalized)")
    generation_config: str = option(
        "auto", "default sampling parameters: auto (the model's generation_config.json: "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), "
        "vllm (none: the neutral defaults), or a folder holding a generation_config.json")
    override_generation_config: str | None = option(
        None, "generation fields set over --generation-config, a JSON object (vLLM's), e.g. "
        "'{\"temperature\": 0.5, \"max_new_tokens\": 128}' (from Python also a dict)")
    speculative_config: str | None = option(
        None, "speculative decoding as JSON (vLLM's names), e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' "
        "or '{\"model\": \"path/to/draft\", \"num_speculative_tokens\": 4}' (a draft model "
        "sharing the tokenizer) (from Python also a dict); greedy outputs are unchanged, sampled ones keep their "
        "distribution (see README, Speculative decoding)", aliases=("-sc",))
    long_prefill_token_threshold: int = option(
        0, "with chunked prefill, at most this many of a prompt's tokens in one step, so that "
        "long prompts share steps with the others (vLLM's; 0: no limit but the step's budget)")
    prompt_budget_per_decode_row: int = option(
        32, "with chunked prefill, a step's token budget grows with its decode rows: this many "
        "a row, at least 24 times as many, never below the next prompt's remaining tokens, at "
        "most --max-num-batched-tokens; so that in a burst the first prompts' first tokens do "
        "not wait for a full-budget step (0: every step takes --max-num-batched-tokens, as vLLM)")
    structured_outputs_config: str | None = option(
        None, "vLLM's structured-outputs config, a JSON object: disable_any_whitespace (as "
        "--structured-outputs-disable-any-whitespace), reasoning_parser, backend (auto or "
        "xgrammar: the one here)")
    scheduling_policy: str = option(
        "fcfs", "fcfs: requests are served in arrival order; priority: by each request's "
        "priority (lower first; ties by arrival), and the lowest priority is preempted first",
        choices=SCHEDULING_POLICIES)
    # multi-LoRA serving (vLLM's names; src/pagedserve/lora/)
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT folders) over the base model: requests name one with "
        "lora_request (the server: --lora-modules, the adapter's name as `model`)")
    max_loras: int = option(1, "most distinct LoRA adapters in one batch (slots on the compute "
                               "device)")
    max_lora_rank: int = option(16, "largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded in CPU memory, least recently used dropped first "
        "(default: max_loras)")

    pipeline_parallel_size: int = option(
        1, "pipeline stages: the decoder layers split into this many contiguous stages, one Ray "
        "actor each, micro-batches in flight so that the stages overlap (on Ray; "
        "tensor_parallel_size 1)", aliases=("-pp",))
    # data parallelism and the engine core apart (vLLM's names; engine/core_client.py)
    data_parallel_size: int = option(
        1, "engine cores behind one front end, each with its own scheduler and KV cache (and its "
        "own tensor_parallel_size workers); requests go to one of them by "
        "--data-parallel-routing (vLLM's data parallelism)", aliases=("-dp",))
    data_parallel_backend: str = option(
        "mp", "where the engine cores run: mp (processes on this machine, its CPUs split "
        "between them, each core's compute threads bound to its share) or ray (Ray actors, a "
        "placement group each, across the cluster's machines)", choices=DATA_PARALLEL_BACKENDS, aliases=("-dpb",))
    data_parallel_routing: str = option(
        "prefix", "which engine core takes a request: prefix (the one holding its longest "
        "cached prefix, from the cores' KV events, unless its load exceeds the least loaded "
        "core's, plus the history that core lacks, by --data-parallel-load-threshold tokens "
        "and by half), least-load (queued + running "
        "tokens) or round-robin", choices=DATA_PARALLEL_ROUTINGS)
    data_parallel_load_threshold: int = option(
        2048, "prefix routing: the most tokens of load the core holding a request's prefix may "
        "carry over the least loaded core (plus the prompt tokens that core lacks) before the "
        "request goes to the least loaded one, if it also carries over 1.5x that")
    data_parallel_restart_lost: bool = option(
        False, "start a fresh engine core in place of one that died (mp backend; it takes "
        "requests again once its model is loaded); off: the server serves on without it and "
        "/health reports it lost")
    engine_core_process: bool = option(
        False, "run the engine core (scheduler and model) in its own process, the front end "
        "(tokenizer, detokenizer, HTTP) apart, over a zmq socket (vLLM v1's layout; always so "
        "with data_parallel_size > 1)")
    kv_events_config: str | None = option(
        None, "publish each engine core's KV cache events (block stored / removed / all "
        "cleared) for external routers, vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}' "
        "(data-parallel rank r on port + r) (from Python also a dict)")

    def lora_config(self):
        """The adapters' limits (`lora.request.LoRAConfig`), or None without enable_lora."""
        if not self.enable_lora:
            return None
        from pagedserve.lora.request import LoRAConfig

        return LoRAConfig(self.max_loras, self.max_lora_rank,
                          self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras)

    def __post_init__(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        self._read_vllm_environment()
        if self.structured_outputs_config is not None:
            self._apply_structured_outputs_config()
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in [1, 256], got {self.block_size}")
        for name in ("kv_cache_memory", "num_kv_blocks", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        if self.cpu_threads_bind is not None:
            parse_cpu_list(self.cpu_threads_bind)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not (self.swap_space >= 0 and self.swap_space < float("inf")):
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be >= 0, or -1 (no limit), got {self.max_logprobs}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if isinstance(self.gpu_memory_utilization, bool) or not (
                isinstance(self.gpu_memory_utilization, (int, float))
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.prompt_budget_per_decode_row < 0:
            raise ValueError(f"prompt_budget_per_decode_row must be >= 0, got "
                             f"{self.prompt_budget_per_decode_row}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")
        if self.hf_overrides is not None:
            self.hf_overrides = _json_object("hf_overrides", self.hf_overrides)
        if self.convert == "classify":
            raise ValueError("convert='classify': converting a generative model into a classifier "
                             "is not supported here; serve a *ForSequenceClassification checkpoint "
                             "with runner='pooling'")
        if self.convert == "embed":
            if self.runner == "generate":
                raise ValueError("convert='embed' pools the model's hidden states: it needs "
                                 "runner 'pooling' (or 'auto'), got 'generate'")
            self.runner = "pooling"
        if self.pooler_config is not None:
            PoolerConfig.resolve(self.pooler_config, None)  # ValueError when malformed
        if self.override_generation_config is not None:
            self.override_generation_config = _json_object(
                "override_generation_config", self.override_generation_config)
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # ValueError when malformed
        if self.enable_lora:
            self.lora_config()  # ValueError naming max_loras / max_lora_rank / max_cpu_loras
            if self.tensor_parallel_size != 1:
                raise ValueError("enable_lora: LoRA adapters run with tensor_parallel_size=1 "
                                 f"only, got {self.tensor_parallel_size}")
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
        if pp > 1:
            if self.distributed_executor_backend not in (None, "ray"):
                raise ValueError("pipeline_parallel_size > 1 runs its stages as Ray actors: "
                                 "distributed_executor_backend must be 'ray', got "
                                 f"{self.distributed_executor_backend!r}")
            for name, bad in (("tensor_parallel_size", self.tensor_parallel_size != 1),
                              ("enable_lora", self.enable_lora),
                              ("speculative_config", self.speculative_config is not None)):
                if bad:
                    raise ValueError(f"pipeline_parallel_size={pp} does not run with {name} "
                                     f"({getattr(self, name)!r}) yet")
        for name in ("data_parallel_size", "data_parallel_load_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (
                    1 if name == "data_parallel_size" else 0):
                raise ValueError(f"{name} must be an integer >= "
                                 f"{1 if name == 'data_parallel_size' else 0}, got {value!r}")
        if self.kv_events_config is not None:
            from pagedserve.engine.kv_events import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)  # ValueError when malformed
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker in this process; "
                             f"tensor_parallel_size={self.tensor_parallel_size} needs 'mp' or 'ray'")

    def _read_vllm_environment(self) -> None:
        """vLLM CPU's environment variables, as aliases of options left unset:
        VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) -> kv_cache_memory, VLLM_CPU_OMP_THREADS_BIND
        ("auto", "nobind", or CPU lists, one per rank joined by "|") -> cpu_threads_bind."""
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if space and self.kv_cache_memory is None and self.num_kv_blocks is None:
            try:
                gib = float(space)
            except ValueError:
                raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got "
                                 f"{space!r}") from None
            if gib > 0:  # vLLM: 0 means its default
                self.kv_cache_memory = int(gib * 1024**3)
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if bind and self.cpu_threads_bind is None and bind.strip().lower() not in ("nobind", "all"):
            self.cpu_threads_bind = bind.replace("|", ",")

    def _apply_structured_outputs_config(self) -> None:
        config = _json_object("structured_outputs_config", self.structured_outputs_config)
        backend = config.get("backend", "auto")
        if backend not in ("auto", "xgrammar", None):
            raise ValueError(f"structured_outputs_config.backend {backend!r}: only xgrammar "
                             "(or auto) here")
        if config.get("disable_any_whitespace"):
            self.structured_outputs_disable_any_whitespace = True
        if config.get("reasoning_parser") and self.reasoning_parser is None:
            self.reasoning_parser = config["reasoning_parser"]
        self.structured_outputs_config = None  # applied

    def scheduler_config(self, max_model_len: int, swap_seconds_per_block: float = 0.0,
                         recompute_seconds_per_token: float = 0.0,
                         eos_token_ids: tuple[int, ...] = ()) -> SchedulerConfig:
        """The scheduler's limits for these options and the model's `max_model_len`, the swap /
        recompute cost estimates from the device (`preemption_mode="auto"`), the model's EOS
        token ids."""
        chunked = self.enable_chunked_prefill
        batched = self.max_num_batched_tokens or (2048 if chunked else max(max_model_len, 2048))
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
            max_model_len=max_model_len, enable_chunked_prefill=chunked,
            preemption_mode=self.preemption_mode, swap_seconds_per_block=swap_seconds_per_block,
            recompute_seconds_per_token=recompute_seconds_per_token, eos_token_ids=eos_token_ids,
            scheduling_policy=self.scheduling_policy,
            max_loras=self.max_loras if self.enable_lora else 0,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            prompt_budget_per_decode_row=self.prompt_budget_per_decode_row)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     only: tuple[str, ...] | None = None) -> None:
        """One flag per field (`--field-name`, its type, default and help; booleans also take
        `--no-field-name`), or per field named in `only`. Values are checked by `__post_init__`
        when the options are built (`from_namespace`)."""
        for f in fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = f.metadata
            flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
            text = (meta.get("help") or "").replace("%", "%%")  # argparse formats help with %
            if f.default is not None and "default" not in text:
                text += " (default: %(default)s)"
            kwargs: dict[str, Any] = {"default": f.default, "help": text.strip()}
            kind = _flag_type(f.type)
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = kind
                if meta.get("choices"):
                    kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            parser.add_argument(*flags, **kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field's default value."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The engine options parsed into `ns` (attributes named like the fields; others are
        ignored), with `overrides` on top."""
        values = {k: v for k, v in vars(ns).items() if k in set(cls.field_names())}
        values.update(overrides)
        return cls(**values)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the options of the online engine (`AsyncLLMEngine.from_engine_args`):
    the same fields as `EngineArgs`."""
