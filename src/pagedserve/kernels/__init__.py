"""Compiled CPU kernels (built lazily on first use; every one falls back to torch)."""

from pagedserve.kernels.cpu_gemm import bf16_linear, kernel_available

__all__ = ["bf16_linear", "kernel_available"]
