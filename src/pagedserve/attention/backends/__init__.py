"""Attention backends as classes: `torch` (the reference, any device) and `triton` (CUDA kernels).

A backend is an `AttentionBackend` (`attention.backends.base`):
- `build_metadata(batch)`: the step's `AttentionMetadata` from an `AttentionBatch` of host lists;
- `forward(query, key, value, kv_cache, meta, scale, sliding_window)`: write the new K/V, attend;
- `write_kv(...)`, `copy_blocks(...)`.

Which backend runs where is the platform's choice (`platforms.Platform.attention_backend`: "auto"
is triton on CUDA when it imports, else torch); the metadata remembers the backend that built it
(`meta.impl`), and `layers.attention.PagedAttention` calls `meta.impl.forward` -- no string
dispatch in the layers. This module imports neither torch nor triton (the engine's options read
`BACKEND_CHOICES` from here): triton is imported only when the triton backend is made.
"""

from __future__ import annotations

import importlib

BACKEND_NAMES = ("torch", "triton")
BACKEND_CHOICES = ("auto", *BACKEND_NAMES)  # `EngineArgs.attention_backend`

_CLASSES = {"torch": ("pagedserve.attention.backends.torch_ref", "TorchAttentionBackend"),
            "triton": ("pagedserve.attention.backends.triton_attn", "TritonAttentionBackend")}


def triton_available() -> bool:
    """Whether triton imports here (it is an optional dependency)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_class(name: str) -> type:
    """The `AttentionBackend` class of a concrete backend name ("torch" | "triton")."""
    entry = _CLASSES.get(name)
    if entry is None:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
    module, cls = entry
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, ops=None):
    """A backend instance of a concrete name; `ops` (a `platforms.LayerOps`) gives the torch
    backend its platform's kernels (None: the default layers' ops)."""
    return backend_class(name)(ops=ops)

