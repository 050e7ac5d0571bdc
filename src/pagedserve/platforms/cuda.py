"""The CUDA platform: torch layers (cuBLAS) with Triton's RMSNorm and q/k norm + RoPE kernels
(`CudaLayerOps`), the Triton attention backend when triton imports, CUDA graphs for decode
steps, GPU memory profiling, pinned host buffers."""

from __future__ import annotations

import gc
import logging
from typing import Callable

import torch

from pagedserve.platforms.base import TORCH_OPS, LayerOps, Platform

logger = logging.getLogger(__name__)


class CudaLayerOps(LayerOps):
    """torch's ops, except bf16 RMSNorm, q/k norm + RoPE and a gated MLP's silu(gate) * up on
    CUDA tensors, which run on `kernels.triton_layers` (one launch each instead of ~7, ~10 and 2
    torch kernels).

    NOTE: the kernels round as the eager formulas do (see that module), so a CUDA run keeps the
    tokens of torch's ops up to an ulp of a norm's statistic; float32 stays on torch."""

    name = "cuda"

    def rms_norm(self, x, weight_f32, eps, numerics):
        if not x.is_cuda:
            return None
        from pagedserve.kernels import triton_layers

        return triton_layers.rms_norm(x, weight_f32, eps, numerics)

    def gated_activation(self, gate, up, name):
        if name != "silu" or not gate.is_cuda:
            return None
        from pagedserve.kernels import triton_layers

        return triton_layers.silu_and_mul(gate, up)

    def qk_norm_rope_(self, query, key, cos, sin, q_weight, k_weight, eps, numerics):
        if not query.is_cuda:
            return False
        from pagedserve.kernels import triton_layers

        return triton_layers.qk_norm_rope_(query, key, cos, sin, q_weight, k_weight, eps,
                                           numerics)


class CudaPlatform(Platform):
    """One CUDA device (see the module docstring)."""

    device_type = "cuda"
    device_figures = (20e9, 10e-6, 2e14)
    is_host = False
    pin_memory = True
    can_profile_memory = True
    dist_backend = "nccl"
    gpus_per_worker = 1
    shares_host_threads = False

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        from pagedserve.attention.backends import triton_available

        self.ops = CudaLayerOps() if triton_available() else TORCH_OPS

    def bind(self, model: torch.nn.Module) -> torch.nn.Module:
        """The ops (`Platform.bind`), then the projections that read one input (q/k/v,
        gate/up of a `layers.linear.FusableLinears` module) re-homed into one buffer each, so
        that each group is one GEMM (`layers.linear.fuse_linears`; no memory added)."""
        super().bind(model)
        for module in model.modules():
            fuse = getattr(module, "fuse_linear_groups", None)
            if callable(fuse):
                fuse()
        return model

    def auto_dtype(self, checkpoint_dtype):
        """The checkpoint's dtype; bfloat16 where it names none and the GPU supports it, else
        float16."""
        dtype = checkpoint_dtype()
        if dtype is not None:
            return dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def default_attention_backend(self) -> str:
        from pagedserve.attention.backends import triton_available

        return "triton" if triton_available() else "torch"

    def worker_device(self, index: int = 0, num_threads: int | None = None) -> torch.device:
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        self.device = device
        return device

    def use_cuda_graphs(self, enforce_eager: bool, backend) -> bool:
        if enforce_eager:
            return False
        if not backend.supports_graphs:
            logger.info("CUDA graphs off: the %s attention backend builds per-step host-side "
                        "groups (use attention_backend='triton')", backend.name)
            return False
        return True

    def empty_cache(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def process_group_options(self) -> dict:
        return {"device_id": self.device}

    @torch.inference_mode()
    def measure_peak_memory(self, run: Callable[[], object]) -> tuple[int, int]:
        """`run()` (the worker's largest step, `worker.worker.profile_memory`) on this device,
        measured: (the device's total memory, torch's peak allocation during it plus the memory
        outside torch's allocator)."""
        device = self.device
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()  # (what it allocated is freed when it returns)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        # Memory outside torch's allocator (CUDA context, cuBLAS/NCCL buffers, other processes).
        outside = max(0, (total - free) - torch.cuda.memory_reserved(device))
        gc.collect()
        torch.cuda.empty_cache()
        logger.info("memory profile on %s: peak %.2f GiB in torch + %.2f GiB outside it, of %.2f GiB",
                    device, peak / 2**30, outside / 2**30, total / 2**30)
        return int(total), int(peak + outside)
