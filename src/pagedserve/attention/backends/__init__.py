"""Attention backends: `torch` (the reference, any device) and `triton` (CUDA kernels).

A backend is a module with the same functions:
- `write_kv(key, value, k_cache, v_cache, slot_mapping)`
- `paged_attention(query, key, value, k_cache, v_cache, meta, scale, sliding_window=None)`
- `copy_blocks(kv_caches, src, dst)`

The model runner resolves the backend once (`resolve_backend`) and builds each step's
`AttentionMetadata` with `backend=<name>`; `PagedAttention` dispatches on `meta.backend`.
Triton is imported only when the triton backend is used: it is not a runtime requirement.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagedserve.config import ATTENTION_BACKENDS as BACKEND_CHOICES
_MODULES = {"torch": "pagedserve.attention.backends.torch_ref",
            "triton": "pagedserve.attention.backends.triton_attn"}


def triton_available() -> bool:
    """Whether triton imports here (it is an optional dependency)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend name for `name` ("auto" | "torch" | "triton") on `device`: "auto" is
    triton on CUDA when triton imports, else torch."""
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_CHOICES}")
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
    return name


def get_backend(name: str, device: torch.device | str = "cpu") -> ModuleType:
    """The backend module for `name` ("auto" | "torch" | "triton") on `device`."""
    return importlib.import_module(_MODULES[resolve_backend(name, device)])


def backend_module(resolved: str) -> ModuleType:
    """The module of an already resolved backend name (`meta.backend`); no device check."""
    module = _MODULES.get(resolved)
    if module is None:
        raise ValueError(f"unknown attention backend {resolved!r}; expected 'torch' or 'triton'")
    return importlib.import_module(module)
