"""Building a model from an HF config and filling it from safetensors (or with dummy weights).

Only safetensors are read; pickled checkpoints (`*.bin`, `torch.load`) are never touched.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import GemmaRMSNorm, RMSNorm
from pagedserve.layers.weights import copy_into, expected_shape
from pagedserve.models.registry import get_model_class
from pagedserve.platforms import Platform, platform_for

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _checkpoint_dtype(config: Any) -> torch.dtype | None:
    """`config.dtype` (transformers 5) or `torch_dtype` (4), of the text config for multimodal ones."""
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if isinstance(value, str):
            value = _DTYPE_NAMES.get(value)
        if isinstance(value, torch.dtype):
            return value
    return None


def resolve_dtype(name: str, config: Any, device: torch.device | str,
                  platform: Platform | None = None) -> torch.dtype:
    """The model dtype for a `--dtype` style `name`: "float32", "bfloat16", "float16" (or their
    short forms) as given; "auto" is the platform's choice (`Platform.auto_dtype`; `platform`
    None: `platform_for(device)`): on a CPU bfloat16 where it is the fast path (native BF16
    instructions, or our bf16 kernels on AVX2), else float32; on CUDA the checkpoint's dtype
    (`config.dtype` / `torch_dtype`), else bfloat16 where the GPU supports it, else float16."""
    key = str(name).lower()
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    if key != "auto":
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(_DTYPE_NAMES)}")
    platform = platform or platform_for(device)
    # NOTE: the checkpoint's dtype is read only where the platform asks (reading
    # `config.torch_dtype` warns under transformers 5)
    return platform.auto_dtype(lambda: _checkpoint_dtype(config))


def iter_safetensors(folder: str | Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every `(name, tensor)` of an HF model folder, read lazily (one tensor at a time) from
    `model.safetensors` or from the shards listed in `model.safetensors.index.json`.

    `lazy=True` yields safetensors slices instead of tensors: indexing one reads only those
    elements (a tensor-parallel worker reads only its shard)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    for file in files:
        with safe_open(folder / file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


@contextmanager
def _build_context(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create tensors on `device` in `dtype` inside, with torch's random parameter
    initialisation (`torch.nn.init`'s random fills) skipped; restores both afterwards.
    (The default dtype and `torch.nn.init` are process-wide while inside: build models from one
    thread at a time.)

    NOTE: every parameter is then written by the checkpoint (`load_named_weights` raises on any
    it did not provide) or by `init_dummy_weights`, so the constructors' random fills were pure
    start-up cost: ~5 s of the embedded model's start on 2 busy cores (nn.Linear's
    kaiming_uniform_ over every matrix, the 262k x 640 embedding's normal_), for tensors the
    GGUF's quantized blocks replace anyway (docs/benchmarks.md, "Start-up")."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(torch.nn.init, name, _keep)
    try:
        with device:
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)
        torch.set_default_dtype(previous)


# torch.nn.init's random fills, skipped while a model is built (see _build_context)
_RANDOM_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "trunc_normal_", "orthogonal_")


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill `model` with deterministic random weights for `seed`: matrices and embeddings
    N(0, 0.02), biases 0, norm scales 1 (Gemma norms store offsets: 0).

    NOTE: a tensor-parallel shard draws the full tensor and keeps its part, so every
    `tensor_parallel_size` gets the same model for the same seed."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, GemmaRMSNorm) or pname == "bias":
                param.zero_()
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                param.fill_(1.0)
            else:
                gen = generators.get(param.device)
                if gen is None:
                    gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                if getattr(param, "shard", None) is None:
                    param.normal_(0.0, 0.02, generator=gen)
                else:
                    full = param.new_empty(expected_shape(param))
                    copy_into(param, full.normal_(0.0, 0.02, generator=gen))


def load_model(
    config: Any,
    *,
    weights: Iterable[tuple[str, torch.Tensor]] | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    tp: TPContext = SINGLE,
    quantization: str = "none",
    batch_invariant: bool = False,
    platform: Platform | None = None,
    max_model_len: int | None = None,
    int8_activations: bool = True,
) -> nn.Module:
    """Build our model for the HF `config` on `device` in `dtype` and load `weights` (HF names,
    e.g. from `iter_safetensors`), or fill dummy weights from `seed` when `weights` is None.
    With `tp` of several ranks the model is this rank's shard and loads only its part of each
    tensor. `quantization` ("none" | "gguf" | "int8", see `layers.quantization`): "gguf" keeps
    the quantized tensors `weights` yields as blocks (they come that way from
    `ModelSource.iter_weights(keep_quantized=True)`), "int8" quantizes the linear layers and
    embeddings after loading; `batch_invariant` puts every quantized product on one kernel for
    all row counts (`layers.quantization.set_batch_invariant`); `int8_activations=False`
    multiplies GGUF blocks with x as it is (`QuantSpec.int8_activations`). The layers run
    `platform`'s ops (`Platform.bind`; None: `platform_for(device)`). `max_model_len`: the longest
    context it will serve (LongRoPE chooses its factors by it; None: the model's own limit).
    Returns the model in eval mode without gradients."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)
    model_class = get_model_class(config)
    with _build_context(device, dtype):
        model = model_class(config, tp=tp)
        if max_model_len is not None:
            for module in model.modules():  # RoPE whose frequencies depend on the context served
                if hasattr(module, "set_max_model_len"):
                    module.set_max_model_len(max_model_len)
    model.requires_grad_(False)
    if weights is None:
        init_dummy_weights(model, seed)
    else:
        model.load_weights(weights)
    if quantization == "int8":
        from pagedserve.layers.quantization import quantize_model_int8

        quantize_model_int8(model)
    if batch_invariant:
        from pagedserve.layers.quantization import set_batch_invariant

        set_batch_invariant(model)
    if not int8_activations:  # EngineArgs.gguf_activations: x multiplied as it is
        from pagedserve.layers.quantization import set_int8_activations

        set_int8_activations(model, False)
    (platform or platform_for(device)).bind(model)
    release_freed_memory()
    return model.eval()


def release_freed_memory(collect_garbage: bool = False) -> None:
    """Hand the heap memory freed while loading (dequantized GGUF tensors, checkpoint buffers)
    back to the OS, so that resident memory is the model's, not the loader's high-water mark.
    glibc's `malloc_trim`; a no-op elsewhere. `collect_garbage` runs `gc.collect()` first.

    NOTE: the loaders call it without `collect_garbage`: what they free goes by reference
    counts (a collection after loading the embedded model found 6 objects and no memory), and
    a full collection costs ~0.4 s in a process holding millions of objects (a test session
    building hundreds of engines)."""
    import ctypes
    import ctypes.util
    import gc

    if collect_garbage:
        gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
