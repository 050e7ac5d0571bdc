"""Weights kept quantized in a model (CPU): GGUF blocks as loaded, or INT8 computed at load.

- `QuantizedTensor`: a checkpoint tensor as its format's rows of blocks (what
  `models.gguf_loader.iter_gguf_weights(..., keep_quantized=True)` yields for the block formats
  the kernel reads); `layers.weights.load_named_weights` installs it with `install_quantized`.
- `quantize_model_int8(model)`: weight-only INT8, one scale per output row, for every linear
  layer, LM head and embedding table of a loaded model.
- `resolve_quantization(...)`: what `EngineArgs.quantization` means for a model source.
- `set_batch_invariant(model)`: `EngineArgs.batch_invariant`, every quantized product on the one
  kernel whose rows do not depend on their batch.

A quantized weight replaces the module's `weight` Parameter (in every module sharing it: a tied
LM head and embedding stay tied) by a uint8 Parameter carrying a `kernels.cpu_qlinear.QuantSpec`;
the layers' products (`kernels.cpu_gemm.bf16_linear`) and embedding lookups see it there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
from torch import nn

from pagedserve.kernels.cpu_qlinear import (  # the weight formats (FORMATS: by name)
    FORMATS,
    GGML_FORMATS,
    QuantFormat,
    QuantSpec,
    quantize_int8,
    quantized_available,
    set_quant,
)
from pagedserve.platforms import platform_for

logger = logging.getLogger(__name__)

HF_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors", "fp8")
"""HF checkpoints' packed methods (`quantization_config.quant_method`) `layers.hf_quant` reads."""

QUANTIZATIONS = ("none", "gguf", "int8", *HF_QUANTIZATIONS)
"""`EngineArgs.quantization` values (None: "gguf" for a GGUF file on CPU, the checkpoint's
`quantization_config.quant_method` for an HF one that has one (`layers.hf_quant`), else
"none")."""


class QuantizedTensor:
    """A 2-D checkpoint tensor `[N, K]` kept as `data`, uint8 `[N, row_bytes]` rows of `format`
    blocks (or 3-D `[E, N, K]` as `[E, N, row_bytes]`: an MoE layer's stacked experts).
    `dequantize()` gives the float32 values (for parameters that cannot stay quantized): gguf's
    dequantizer for `ggml_type`, else `dequantizer(data, K)` (a format of no GGUF type,
    `layers.hf_quant`'s: `ggml_type` -1). `perm` (int64 `[K]` or None): the rows hold the input
    features in that order (GPTQ act-order, see `layers.hf_quant`); a stack's is `[E, K]`, each
    expert's own order."""

    def __init__(self, data: torch.Tensor, format: QuantFormat, shape: tuple[int, ...], ggml_type: int,
                 perm: torch.Tensor | None = None,
                 dequantizer: Callable[[torch.Tensor, int], torch.Tensor] | None = None):
        if data.dtype != torch.uint8 or data.dim() != len(shape) or data.dim() not in (2, 3) \
                or tuple(data.shape[:-1]) != tuple(shape[:-1]):
            raise ValueError(f"quantized tensor data must be uint8 [{', '.join(map(str, shape[:-1]))}, row_bytes]")
        if data.shape[-1] != format.row_bytes(shape[-1]):
            raise ValueError(f"{format.name} rows of {shape[-1]} values take {format.row_bytes(shape[-1])} bytes")
        if perm is not None and tuple(perm.shape) not in ((shape[-1],), (*shape[:-2], shape[-1])):
            raise ValueError(f"perm must hold the {shape[-1]} input features (of each expert), "
                             f"got {tuple(perm.shape)}")
        self.data, self.format, self.shape, self.ggml_type = data, format, tuple(shape), ggml_type
        if ggml_type < 0 and dequantizer is None:
            raise ValueError("a quantized tensor of no GGUF type needs its dequantizer")
        self.perm, self.dequantizer = perm, dequantizer

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def dequantize(self) -> torch.Tensor:  # float32 [N, K]
        if self.ggml_type < 0:
            values = self.dequantizer(self.data, self.shape[-1])  # [N, K]
            return unpermute(values, self.perm)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(self.data.numpy(), GGMLQuantizationType(self.ggml_type)).copy())


def unpermute(values: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Values `[..., N, K]` whose input features are in order `perm` (`[K]`, or `[..., K]`: one
    order per leading index, an MoE stack's experts) back in the checkpoint's feature order."""
    if perm is None:
        return values
    if perm.dim() == 1:
        return torch.empty_like(values).index_copy_(-1, perm, values)
    index = perm.unsqueeze(-2).expand_as(values)  # [..., N, K]
    return torch.empty_like(values).scatter_(-1, index, values)


def _quantizable_classes() -> tuple[type, ...]:
    from pagedserve.layers.linear import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    return ColumnParallelLinear, RowParallelLinear, ParallelLMHead, VocabParallelEmbedding


def owners_of(model: nn.Module, param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """(module, name) of every place `param` is registered in `model` (a tied weight: several)."""
    return [(m, k) for m in model.modules() for k, p in m._parameters.items() if p is param]


def can_quantize(model: nn.Module, param: torch.Tensor) -> bool:
    """Whether `param` may be replaced by a quantized weight: the `weight` of linear layers, LM
    heads and embeddings, and the stacked expert weights of MoE layers (a module's
    `quantizable` names), on one rank, in a CPU model."""
    owners = owners_of(model, param)
    classes = _quantizable_classes()
    return bool(owners) and platform_for(param.device).is_host and all(
        ((isinstance(m, classes) and k == "weight") or k in getattr(m, "quantizable", ()))
        and not m.tp.is_parallel for m, k in owners
    )


def install_quantized(model: nn.Module, param: torch.Tensor, weight: torch.Tensor) -> nn.Parameter:
    """Replace `param` by `weight` (uint8, marked by `set_quant`) in every module holding it;
    returns the new parameter."""
    new = nn.Parameter(weight, requires_grad=False)
    new.quant = weight.quant
    for module, key in owners_of(model, param):
        module._parameters[key] = new
    return new


def install_quantized_tensor(model: nn.Module, param: torch.Tensor, source: QuantizedTensor) -> nn.Parameter:
    """Install checkpoint blocks `source` in place of `param` (its shape already checked);
    returns the new parameter."""
    spec = QuantSpec(source.format, source.shape[-1], param.dtype, perm=source.perm)
    return install_quantized(model, param, set_quant(source.data, spec))


@torch.no_grad()
def quantize_model_int8(model: nn.Module) -> int:
    """Weight-only INT8 (per output row) for every linear layer, LM head and embedding table of
    `model` that is not already quantized; returns how many weights were converted."""
    seen: set[int] = set()
    count = 0
    for module in list(model.modules()):
        names = getattr(module, "quantizable", ())  # an MoE layer's stacked experts [E, N, K]
        if not names and not isinstance(module, _quantizable_classes()):
            continue
        for name in names or ("weight",):
            w = module._parameters.get(name)
            if w is None or id(w) in seen or getattr(w, "quant", None) is not None \
                    or w.dim() != (3 if names else 2):
                continue
            seen.add(id(w))
            if can_quantize(model, w):
                if names:  # one scale per output row of every expert
                    flat = quantize_int8(w.reshape(-1, w.shape[-1]), w.dtype)
                    q = set_quant(flat.view(*w.shape[:-1], flat.shape[-1]), flat.quant)
                else:
                    q = quantize_int8(w, w.dtype)
                install_quantized(model, w, q)
                count += 1
    return count


def set_batch_invariant(model: nn.Module) -> int:
    """Mark every quantized weight of `model` batch-invariant (`QuantSpec.batch_invariant`: its
    products run the 8-bit-activation kernel for every row count); returns how many."""
    seen: set[int] = set()
    for p in model.parameters():
        spec = getattr(p, "quant", None)
        if spec is not None and id(p) not in seen:
            seen.add(id(p))
            p.quant = dataclasses.replace(spec, batch_invariant=True)
    return len(seen)


def set_int8_activations(model: nn.Module, enabled: bool) -> int:
    """Set `QuantSpec.int8_activations` on every quantized weight of `model` (False: ggml blocks
    multiplied with x as it is, dequantized tile by tile); returns how many weights."""
    seen: set[int] = set()
    for p in model.parameters():
        spec = getattr(p, "quant", None)
        if spec is not None and id(p) not in seen:
            seen.add(id(p))
            p.quant = dataclasses.replace(spec, int8_activations=enabled)
    return len(seen)


GGUF_ACTIVATIONS = ("auto", "int8", "dtype")
"""`EngineArgs.gguf_activations`: how products over kept GGUF blocks treat x."""


def resolve_gguf_activations(requested: str, model_default: str | None) -> bool:
    """Whether products over GGUF blocks quantize x to 8 bits: "int8" yes, "dtype" no, "auto"
    the model source's recommendation (`ModelSource.gguf_activations`), else yes."""
    choice = model_default if requested == "auto" and model_default else requested
    return choice != "dtype"


def resolve_quantization(requested: str | None, source_kind: str, device_type: str, world_size: int,
                         checkpoint_method: str | None = None) -> str:
    """What to load: "none", "gguf" (keep a GGUF file's quantized tensors), "int8", or an HF
    checkpoint's packed method ("awq", "gptq", "compressed-tensors", "fp8": `layers.hf_quant`).

    `checkpoint_method`: an HF checkpoint's `quantization_config.quant_method` (None for none).
    None picks it when it is one of `HF_QUANTIZATIONS` (other methods, e.g.
    gpt-oss's mxfp4, are their model's business), "gguf" for a GGUF file on one CPU worker when
    the kernels are available, else "none". ValueError for an explicit choice that cannot apply
    (GPU, tensor parallel, "gguf" on a non-GGUF model, "awq" on a checkpoint of another method,
    kernels unavailable)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {requested!r}")
    if requested in HF_QUANTIZATIONS and requested != checkpoint_method:
        raise ValueError(f"quantization={requested!r} needs a checkpoint whose config.json "
                         f"quantization_config.quant_method is {requested!r}, got {checkpoint_method!r}")
    if requested is None and checkpoint_method in HF_QUANTIZATIONS:
        requested = checkpoint_method
    if requested is None:
        if source_kind != "gguf" or device_type != "cpu" or world_size != 1:
            return "none"
        if not quantized_available():
            logger.warning("quantized CPU kernels unavailable: GGUF weights are dequantized")
            return "none"
        return "gguf"
    if requested == "none":
        return "none"
    if device_type != "cpu":
        raise ValueError(f"quantization={requested!r} runs on CPU only (device is {device_type})")
    if world_size != 1:
        raise ValueError(f"quantization={requested!r} needs tensor_parallel_size=1")
    if requested == "gguf" and source_kind != "gguf":
        raise ValueError("quantization='gguf' needs a GGUF model file")
    if not quantized_available():
        raise ValueError(f"quantization={requested!r} needs the compiled CPU kernels (x86-64 with "
                         "AVX2 and a C++ compiler; not disabled by PAGEDSERVE_DISABLE_CPU_KERNELS)")
    return requested
