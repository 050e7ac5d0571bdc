"""The CPU platform: our compiled kernels (`pagedserve.kernels`) where they apply, torch elsewhere.

`CpuOps` is the only place the layers' CPU kernels are chosen: the batch-invariant float32
kernels (`kernels.cpu_fp32`: products, activations, attention of every token alone), the bf16 /
quantized products (`kernels.cpu_gemm.bf16_linear`, `kernels.cpu_qlinear`), the bf16 argmax,
RMSNorm, q/k norm + RoPE, decode attention and the fused decode layer
(`platforms.cpu_decode`). Each kernel call returns None where it does not apply (kernels
disabled by `PAGEDSERVE_DISABLE_CPU_KERNELS=1` or unavailable, another dtype, a tensor not on the
CPU), and the caller then runs the eager torch formula -- so these ops are also the safe default
of layers built outside any platform (`platforms.OpsUser`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_argmax import argmax_bf16
from pagedserve.kernels.cpu_attention import decode_attention, prefill_attention
from pagedserve.kernels.cpu_fp32 import (invariant_activation, invariant_attention, invariant_gated_activation,
                                         invariant_linear)
from pagedserve.kernels.cpu_moe import moe_experts
from pagedserve.kernels.cpu_norm import rms_norm
from pagedserve.kernels.cpu_recurrent import (
    gated_delta_rule_paged, gather_state, kimi_delta_rule_paged, scatter_state, ssm_scan_paged)
from pagedserve.kernels.cpu_qlinear import qembedding, qlinear_argmax, quantized_available
from pagedserve.kernels.cpu_rotary import NORM_GEMMA, NORM_LLAMA, NORM_NONE, qk_norm_rope_
from pagedserve.platforms import cpu_decode
from pagedserve.platforms.base import LayerOps, Platform

# The layers' numerics names -> the kernels' codes (csrc: cpu_rotary.h)
NORM_CODES = {None: NORM_NONE, "llama": NORM_LLAMA, "gemma": NORM_GEMMA}


class CpuOps(LayerOps):
    """`LayerOps` on the compiled CPU kernels (see the module docstring)."""

    name = "cpu"

    def linear(self, x, weight, bias=None):
        """float32 products on the batch-invariant kernel (None from it: not float32 CPU, or the
        kernels unavailable), the rest through `bf16_linear` (F.linear except for bf16 / quantized
        weights on x86 CPUs)."""
        if x.dtype is torch.float32:
            y = invariant_linear(x, weight, bias)
            if y is not None:
                return y
        return cpu_gemm.bf16_linear(x, weight, bias)

    def linear_heads(self, x, weight):
        """bf16 heads in one call of the kernel `linear` runs for each (`cpu_gemm.linear_heads`);
        None for float32 (its products are the batch-invariant fp32 kernel's) and elsewhere."""
        if x.dtype is not torch.bfloat16:
            return None
        return cpu_gemm.linear_heads(x, weight)

    def quantized_embedding(self, input_ids, weight):
        return qembedding(input_ids, weight)

    def lora_bgmv(self, dtype, device):
        """bf16 adapters on the CPU, kernels available: csrc/lora_bgmv.cpp."""
        return dtype is torch.bfloat16 and device.type == "cpu" and cpu_gemm.kernel_available()

    def lora_shrink(self, x, a_t, slots):
        return torch.ops.pagedserve_cpu.lora_shrink.default(x, a_t, slots, cpu_gemm.linear_isa())

    def lora_expand_(self, y, h, col, b_t, slots):
        torch.ops.pagedserve_cpu.lora_expand_.default(y, h, col, b_t, slots, cpu_gemm.linear_isa())

    def greedy(self, x, weight):
        """The bf16 argmax scan of the LM head's output (`kernels.cpu_argmax`), for bf16 (or
        quantized) weights and bf16 CPU activations; None elsewhere. NOTE: the logits come from
        the same product as `linear`, so a row's greedy token does not depend on its batch.
        Quantized weights: the product and the scan fused (`qlinear_argmax`: no logits in memory),
        the same tokens."""
        quantized = getattr(weight, "quant", None) is not None
        if (x.dim() != 2 or x.dtype is not torch.bfloat16
                or not (quantized or weight.dtype is torch.bfloat16) or not x.is_cpu
                or not cpu_gemm.kernel_available()):
            return None
        if quantized and not (x.requires_grad and torch.is_grad_enabled()):
            return qlinear_argmax(x, weight)
        return argmax_bf16(self.linear(x, weight))

    def rms_norm(self, x, weight_f32, eps, numerics):
        return rms_norm(x, weight_f32, eps, llama=numerics == "llama")

    def qk_norm_rope_(self, query, key, cos, sin, q_weight, k_weight, eps, numerics):
        return qk_norm_rope_(query, key, cos, sin, q_weight, k_weight, eps, NORM_CODES[numerics])

    def activation(self, x, name):
        return invariant_activation(x, name)

    def gated_activation(self, gate, up, name):
        """`act(gate) * up` in one pass (`kernels.cpu_fp32.invariant_gated_activation`): the bits
        of `activation(gate, name) * up`, without the activation's tensor."""
        return invariant_gated_activation(gate, up, name)

    def decoder_layer(self, layer, x, rope, kv_cache, meta):
        return cpu_decode.fused_decode_layer(layer, x, rope, kv_cache, meta)

    def decoder_attention(self, layer, x, rope, kv_cache, meta):
        return cpu_decode.fused_decode_attention(layer, x, rope, kv_cache, meta)

    def moe_experts(self, experts, x, weights, ids, down_bias):
        """The routed experts in one compiled call (`kernels.cpu_moe`: bit-identical to the
        layer's loop) when their activation is a gated one the `Activation` layer runs on this
        platform's kernel, or one that names its kernel formula (`moe_kernel_act`: gpt-oss's
        clamped SwiGLU) and runs on this platform; None otherwise (relu, ...)."""
        module = getattr(experts, "act_module", None)  # layers.activation.Activation, or None
        if module is not None:
            if module.kernel is None or not isinstance(module.ops, CpuOps):
                return None
            act, params = module.kernel, (0.0, 0.0)
        else:  # a custom gated activation module, e.g. models.gpt_oss.ClampedSwiGLU
            spec = getattr(experts.act_fn, "moe_kernel_act", None)  # (name, alpha, limit)
            if spec is None or not isinstance(getattr(experts.act_fn, "ops", None), CpuOps):
                return None
            act, params = spec[0], tuple(spec[1:])
        biases = (experts.gate_proj_bias, experts.up_proj_bias,
                  experts.down_proj_bias if down_bias else None)
        return moe_experts(x, weights, ids, experts.placement.start, experts.gate_proj,
                           experts.up_proj, experts.down_proj, act, biases, params)

    def decode_attention(self, query, k_cache, v_cache, block_tables, seq_lens, scale,
                         sliding_window, *, sinks=None):
        return decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                sliding_window, sinks)

    def invariant_attention(self, query, k_cache, v_cache, block_tables, seq_lens,
                            query_start_loc, scale, sliding_window, softcap=None, *, sinks=None):
        return invariant_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                   query_start_loc, scale, sliding_window, softcap, sinks)

    def prefill_attention(self, query, key, value, out, scale, sliding_window, key_start=0):
        return prefill_attention(query, key, value, out, scale, sliding_window, key_start)

    def paged_state_gather(self, caches, blocks, start, count, fresh):
        return gather_state(caches, blocks, start, count, fresh)

    def paged_state_scatter(self, caches, blocks, start, values):
        return scatter_state(caches, blocks, start, values)

    def gated_delta_rule_paged(self, q, k, v, beta, decay, caches, blocks, start, fresh,
                               query_start_loc):
        return gated_delta_rule_paged(q, k, v, beta, decay, caches, blocks, start, fresh,
                                      query_start_loc)

    def kimi_delta_rule_paged(self, q, k, v, beta, decay, caches, blocks, start, fresh,
                              query_start_loc):
        return kimi_delta_rule_paged(q, k, v, beta, decay, caches, blocks, start, fresh,
                                     query_start_loc)

    def ssm_scan_paged(self, x, dt, A, B, C, D, caches, blocks, start, fresh, query_start_loc):
        return ssm_scan_paged(x, dt, A, B, C, D, caches, blocks, start, fresh, query_start_loc)


CPU_OPS = CpuOps()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has native BF16 dot products (AVX512-BF16 or AMX-BF16), so that torch's
    bf16 matmuls are fast rather than emulated. Reads /proc/cpuinfo (Linux); False elsewhere."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def cpu_prefers_bf16() -> bool:
    """Whether bf16 activations are the fast path on this CPU: it has native BF16 instructions,
    or our compiled bf16 kernels run here (any x86-64 CPU with AVX2 + FMA; builds them on first
    call). NOTE: on AVX2-only CPUs torch's own bf16 ops are emulated; our kernels make bf16 decode
    ~1.8x faster than float32 there (Gemma 3 270M Q4_K_M, docs/benchmarks.md)."""
    return cpu_has_native_bf16() or cpu_gemm.kernel_available()


class CpuPlatform(Platform):
    """The CPU: compiled kernels in the layers (`CpuOps`), the torch attention backend with the
    CPU decode / float32 kernels, no graphs, no memory profiling (the KV cache is sized from
    `kv_cache_memory`)."""

    device_type = "cpu"

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        self.ops = CPU_OPS

    def auto_dtype(self, checkpoint_dtype):
        """bfloat16 where it is the fast path (`cpu_prefers_bf16`), else float32 (the
        checkpoint's dtype does not matter on a CPU)."""
        return torch.bfloat16 if cpu_prefers_bf16() else torch.float32

    def supports_quantization(self) -> bool:
        return quantized_available()

    def worker_device(self, index: int = 0, num_threads: int | None = None) -> torch.device:
        if num_threads:
            torch.set_num_threads(num_threads)
        keep_freed_memory()
        return self.device


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for the next step instead of giving it back to
    the OS: blocks up to 32 MiB come from the heap (not a fresh mmap each), and the heap's free
    top is trimmed only past 1 GiB. True where applied (glibc), once per process.

    NOTE: why: a prompt step allocates and frees the same large buffers every step (the MoE
    kernel's per-expert rows, packed activations, step outputs); returned to the OS after each
    step, they page-faulted back in at the next (~8% of an MoE prefill in kernel page-fault
    paths; with this, 1.23x the MoE prompt throughput on AMX, docs/benchmarks.md). The cost is
    resident memory that stays at the step's peak, which a server reaches anyway."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
