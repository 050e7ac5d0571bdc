"""Platforms: one object per device owning its device-specific choices (attention backend,
layer kernels, the fused decode path, graph capture, memory profiling); see `platforms.base`.

`platform_for(device)` picks the class from the device; the worker calls it once and passes the
platform down (`load_model(..., platform=)`, `KVCache(..., platform=)`,
`ModelRunner(..., platform=)`). Nothing here is global state: a platform is plain data about
one device, and layers hold the `LayerOps` they were bound to.
"""

from __future__ import annotations

import torch

from pagedserve.platforms.base import TORCH_OPS, BindsOps, LayerOps, Platform
from pagedserve.platforms.cpu import CPU_OPS, CpuOps, CpuPlatform
from pagedserve.platforms.cuda import CudaPlatform

__all__ = ["CPU_OPS", "DEFAULT_OPS", "TORCH_OPS", "CpuOps", "CpuPlatform", "CudaPlatform", "LayerOps",
           "OpsUser", "Platform", "accelerator_name", "default_device", "platform_for"]

# The ops of layers (and of the torch attention backend) built outside any platform.
DEFAULT_OPS: LayerOps = CPU_OPS


class OpsUser(BindsOps):
    """Mixin of the layers whose forward calls device-specific ops (`self.ops`, a `LayerOps`).
    `Platform.bind(model)` sets each one's `ops` to its platform's; a layer built outside any
    platform (tests, tools) runs the CPU platform's ops, which fall back to torch off a CPU --
    the same role as `tp=SINGLE` for tensor parallelism."""

    ops: LayerOps = DEFAULT_OPS


_PLATFORMS = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def default_device() -> str:
    """The device `device="auto"` means: "cuda" where torch sees a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def accelerator_name() -> str:
    """The first GPU's name, or "none" (for `collect-env`)."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def platform_for(device: torch.device | str) -> Platform:
    """A new platform for `device` ("cpu", "cuda", "cuda:1", a torch.device)."""
    device = torch.device(device)
    cls = _PLATFORMS.get(device.type)
    if cls is None:
        raise ValueError(f"no platform for device type {device.type!r}; expected one of "
                         f"{sorted(_PLATFORMS)}")
    return cls(device)
