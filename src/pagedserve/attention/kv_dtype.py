"""The KV cache's storage dtype (vLLM's `kv_cache_dtype`) and what fp8 blocks need from torch.

`auto` stores K/V in the model's dtype. `fp8` (= `fp8_e4m3`, vLLM's default fp8) and `fp8_e5m2`
store one byte per element (torch's `float8_e4m3fn` / `float8_e5m2`): half the bytes of a bf16
cache per token, so twice the tokens in the same budget. K/V are converted to fp8 when written
(`to_cache`) and widened back to fp32 / the model's dtype wherever attention reads them (the CPU
kernels widen each row as they load it; the torch paths with `.to()` / `.float()`).

Scales: vLLM multiplies by a per-layer k / v scale that fp8 checkpoints may carry, else 1.0.
pagedserve loads no fp8 checkpoint (their weights are formats it does not read), so the scale
is always 1.0 here: values are stored as they are, saturated to the format's largest finite
value (as vLLM's conversion does: ±448 for e4m3, ±57344 for e5m2).

NOTE: torch implements few CPU ops for float8 tensors (no index_copy_ / index_fill_): block
copies, swaps and writes go through a `uint8` view of the same bytes (`as_bytes`).
"""

from __future__ import annotations

import torch

# vLLM's names -> torch storage dtypes ("auto": the model's own, see `kv_cache_dtype`)
FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# the largest finite value of each format (values beyond are stored as it)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype KV blocks are stored in for `kv_cache_dtype=name` and a model of
    `model_dtype`. ValueError naming `kv_cache_dtype` for an unknown name."""
    if name == "auto":
        return model_dtype
    try:
        return FP8_DTYPES[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(FP8_DTYPES)}, "
                         f"got {name!r}") from None


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds fp8 blocks."""
    return dtype in _FP8_MAX


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in a cache's storage dtype: fp8 rounded to nearest (even), saturated to the format's
    largest finite value (NaN stays NaN); any other dtype a plain `.to()`."""
    if dtype not in _FP8_MAX:
        return x.to(dtype)
    limit = _FP8_MAX[dtype]
    return x.clamp(-limit, limit).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A `uint8` view of an fp8 tensor (the ops torch lacks for float8 on CPU run on it); any
    other tensor as it is."""
    return t.view(torch.uint8) if t.dtype in _FP8_MAX else t


def fill_value(dtype: torch.dtype, value: float):
    """What `index_fill_` writes into `as_bytes` of a cache of `dtype` for `value` (tests fill
    freed blocks with NaN): the fp8 bit pattern as an int, else `value` itself."""
    if dtype not in _FP8_MAX:
        return value
    return int(torch.tensor([value]).to(dtype).view(torch.uint8).item())
