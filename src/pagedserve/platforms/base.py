"""The platform seam: what a device decides, in one object per device, chosen once.

A `Platform` (`platforms.platform_for(device)`: `CpuPlatform` or `CudaPlatform`) is built by the
worker from its device and passed down explicitly: to `models.loader.load_model` (which binds the
platform's `LayerOps` into the model's layers), to the `KVCache` and to the `ModelRunner`. It owns
every device-specific choice the layers, attention and the worker used to make with their own
device / dtype checks:

- the attention backend (`attention_backend("auto" | "torch" | "triton")`, an
  `attention.backends.AttentionBackend` instance);
- the layers' ops (`ops`, a `LayerOps`): linear products, quantized embedding rows, the greedy
  argmax, fused RMSNorm, q/k norm + RoPE, float32 activations, the fused decode layer, the torch
  attention backend's decode and float32 kernels;
- CUDA graph capture (`use_cuda_graphs`), GPU memory measurement (`measure_peak_memory`),
  pinned host memory, the allocator's cache, device figures for KV sizing and preemption.

This module is the base: plain torch, valid on any device. Models stay plain torch and import no
kernel module; only `platforms/` chooses kernels (tests/test_layering.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKEND_AUTO = "auto"


class BindsOps:
    """What `Platform.bind` looks for: a layer whose forward calls device-specific ops
    (`self.ops`, a `LayerOps`). The layers use the `platforms.OpsUser` mixin, which also gives
    `ops` its default: the CPU platform's ops, which this module cannot name (platforms/cpu.py
    builds on it)."""

    ops: LayerOps


class LayerOps:
    """The device-specific ops the layers call (`layer.ops`), here in plain torch: valid on every
    device. A method returning None (or False) means "not taken here: run the eager torch
    formula"; the caller then does exactly what it would without a kernel.

    NOTE: stateless: one instance may be shared by every layer of every model.
    """

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`. NOTE: every product of a model (LM head included) comes
        through here, so a platform can keep a row's bits independent of its batch."""
        return F.linear(x, weight, bias)

    def linear_heads(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """`y[:, h] = linear(x[:, h], weight[h])` for x `[T, Hh, K]`, weight `[Hh, N, K]` in one
        call, bit-identical to `linear` head by head; or None: the caller loops over the heads."""
        return None

    def lora_bgmv(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `lora_shrink` / `lora_expand_` (per-token LoRA products, Punica's BGMV) run
        here for adapters of `dtype` on `device`; False: `lora.layers` runs its torch paths."""
        return False

    def lora_shrink(self, x: torch.Tensor, a_t: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:  # [T, W] float32
        """Each token's `x[t] @ a_t[slots[t]]` (a_t [slots, in, W]; 0 where slots[t] < 0)."""
        raise NotImplementedError("lora_shrink: only where lora_bgmv is True")

    def lora_expand_(self, y: torch.Tensor, h: torch.Tensor, col: int, b_t: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """`y[t] += h[t, col:col + R] @ b_t[slots[t]]` in place (b_t [slots, R, out]; tokens of
        slot < 0 untouched)."""
        raise NotImplementedError("lora_expand_: only where lora_bgmv is True")

    def quantized_embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of a quantized embedding table (a platform with quantized weights only)."""
        raise ValueError("quantized weights need the CPU platform's kernels")

    def greedy(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """`linear(x, weight).float().argmax(-1)` without fp32 logits, or None: not here."""
        return None

    def rms_norm(self, x: torch.Tensor, weight_f32: torch.Tensor, eps: float,
                 numerics: str) -> torch.Tensor | None:
        """A fused RMSNorm (`numerics` "llama" | "gemma"), or None: the eager formula."""
        return None

    def qk_norm_rope_(self, query, key, cos, sin, q_weight, k_weight, eps: float,
                      numerics: str | None) -> bool:
        """Per-head q/k norm (`numerics` None: no norm) and RoPE in place; False: not done."""
        return False

    def activation(self, x: torch.Tensor, name: str) -> torch.Tensor | None:
        """A float32 / bf16 activation ("silu" | "gelu_tanh" | "sigmoid") on a kernel, or None:
        torch's."""
        return None

    def gated_activation(self, gate: torch.Tensor, up: torch.Tensor,
                         name: str) -> torch.Tensor | None:
        """`act(gate) * up` (a gated MLP's middle; `name` as `activation`'s) in one kernel, or
        None: the activation, then the product."""
        return None

    def decoder_layer(self, layer, x, rope, kv_cache, meta) -> torch.Tensor | None:
        """A whole decoder layer (`models.llama.FusableDecoderLayer`) in one call, or None: the
        layer runs its modules."""
        return None

    def decoder_attention(self, layer, x, rope, kv_cache, meta) -> tuple | None:
        """The attention half of a decoder layer whose feed-forward runs apart
        (`models.mixtral.MoEDecoderLayer`) in one call: `(r, h)`, the residual after attention and
        the feed-forward's normed input; or None: the layer runs its modules."""
        return None

    def moe_experts(self, experts, x, weights, ids, down_bias: bool) -> torch.Tensor | None:
        """An MoE layer's routed experts (`layers.moe.MoEExperts`) on a kernel: the float32
        `[T, H]` weighted sum of each token's experts, or None: the layer's torch loop."""
        return None

    def decode_attention(self, query, k_cache, v_cache, block_tables, seq_lens, scale,
                         sliding_window, *, sinks=None) -> torch.Tensor | None:
        """The torch attention backend's decode rows on a kernel, or None: torch's."""
        return None

    def invariant_attention(self, query, k_cache, v_cache, block_tables, seq_lens,
                            query_start_loc, scale, sliding_window, softcap=None, *,
                            sinks=None) -> torch.Tensor | None:
        """The torch attention backend's whole step on a batch-invariant kernel (scores capped
        as `softcap * tanh(s / softcap)` when `softcap` is set; per-head `sinks` logits when
        given), or None."""
        return None

    def prefill_attention(self, query, key, value, out, scale, sliding_window, key_start=0) -> bool:
        """A prompt chunk's attention over its context written into `out` on a kernel (key 0 of
        `key` / `value` at position `key_start` of the sequence); False: the torch backend runs
        SDPA."""
        return False

    def paged_state_gather(self, caches, blocks, start: int, count: int,
                           fresh) -> torch.Tensor | None:
        """Values `[start, start + count)` of each sequence's recurrent state kept in the cache
        (`layers.recurrent_state.PagedState.paged`), zeros where `fresh`: `[S, count]` float32,
        or None: the state's torch path."""
        return None

    def paged_state_scatter(self, caches, blocks, start: int, values) -> bool:
        """Store `values [S, count]` as values `[start, start + count)` of each sequence's state;
        False (nothing written): the state's torch path."""
        return False

    def gated_delta_rule_paged(self, q, k, v, beta, decay, caches, blocks, start, fresh,
                               query_start_loc) -> torch.Tensor | None:
        """Gated DeltaNet's recurrence (`layers.gated_delta_net`) on a kernel, its state read and
        stored in place in the paged cache (`layers.recurrent_state.PagedState.paged`):
        the outputs `[T, H, V]`, or None: the layer's torch loop."""
        return None

    def kimi_delta_rule_paged(self, q, k, v, beta, decay, caches, blocks, start, fresh,
                              query_start_loc) -> torch.Tensor | None:
        """Kimi Delta Attention's recurrence (`layers.kimi_delta_attention`): the gated delta
        rule with a decay per key channel (`decay [T, H, K]`), in place in the paged cache as
        `gated_delta_rule_paged`; the outputs `[T, H, V]`, or None: the layer's torch loop."""
        return None

    def ssm_scan_paged(self, x, dt, A, B, C, D, caches, blocks, start, fresh,
                       query_start_loc) -> torch.Tensor | None:
        """Mamba 2's selective scan (`layers.mamba2`) on a kernel, its state read and stored in
        place in the paged cache (`layers.recurrent_state.PagedState.paged`): the outputs
        `[T, H, P]` with the D skip, or None: the layer's torch loop."""
        return None


TORCH_OPS = LayerOps()


class Platform:
    """One device's choices (see the module docstring); the base is what any torch device does.
    Subclasses: `platforms.cpu.CpuPlatform`, `platforms.cuda.CudaPlatform`."""

    device_type = "cpu"
    # Rough figures for preemption_mode="auto" (`worker.kv_cache.preemption_costs`): copy
    # bandwidth between the pools (B/s), fixed cost per block moved (s), compute (FLOP/s).
    device_figures = (10e9, 2e-6, 1e11)
    is_host = True  # the device is the host's memory: a step's results need no transfer back
    pin_memory = False  # host buffers (swap pool, what a step brings back) pinned
    can_profile_memory = False  # `measure_peak_memory` sizes the KV cache from a profiled peak
    dist_backend = "gloo"  # torch.distributed's backend between this device's workers
    gpus_per_worker = 0  # accelerators one worker holds (Ray bundles)
    shares_host_threads = True  # workers split the host's CPU threads (and may bind to CPUs)

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device if device is not None else self.device_type)
        self.ops: LayerOps = TORCH_OPS

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # --- models -------------------------------------------------------------------------------

    def bind(self, model: torch.nn.Module) -> torch.nn.Module:
        """Give every layer of `model` that calls device-specific ops (`BindsOps`: the
        `platforms.OpsUser` mixin) this platform's `ops`; returns `model`."""
        for module in model.modules():
            if isinstance(module, BindsOps):
                module.ops = self.ops
        return model

    def auto_dtype(self, checkpoint_dtype) -> torch.dtype:
        """The model dtype for `dtype="auto"`; `checkpoint_dtype()` reads the checkpoint's (None:
        it names none)."""
        return checkpoint_dtype() or torch.float32

    def supports_quantization(self) -> bool:
        """Whether quantized weights (GGUF blocks, INT8) run here."""
        return False

    # --- attention ----------------------------------------------------------------------------

    def default_attention_backend(self) -> str:
        """What "auto" means here."""
        return "torch"

    def attention_backend(self, name: str = BACKEND_AUTO):
        """The attention backend `name` ("auto" | "torch" | "triton") for this device, as an
        `attention.backends.AttentionBackend`; ValueError for an unknown name or a backend that
        cannot run here."""
        from pagedserve.attention.backends import BACKEND_CHOICES, make_backend, triton_available

        if name not in BACKEND_CHOICES:
            raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_CHOICES}")
        if name == BACKEND_AUTO:
            name = self.default_attention_backend()
        if name == "triton" and not triton_available():
            raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
        return make_backend(name, ops=self.ops)

    def resolve_attention_backend(self, name: str) -> str:
        """The concrete backend name `attention_backend(name)` gives."""
        return self.attention_backend(name).name

    # --- the worker ---------------------------------------------------------------------------

    def worker_device(self, index: int = 0, num_threads: int | None = None) -> torch.device:
        """Set this process up for the worker of local `index`; returns its device."""
        return self.device

    def use_cuda_graphs(self, enforce_eager: bool, backend) -> bool:
        """Whether decode steps replay captured graphs (`worker.cuda_graphs`)."""
        return False

    def measure_peak_memory(self, run) -> tuple[int, int]:
        """Run `run()` (the worker's largest step) and measure it: (the device's total memory,
        the peak it reached); see `CudaPlatform`. The platform measures, the worker runs: a
        platform describes its device and imports nothing of what runs on it."""
        raise ValueError("GPU memory profiling needs a CUDA device")

    def empty_cache(self) -> None:
        """Return the allocator's cached memory to the device (after freeing the KV cache)."""

    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    def process_group_options(self) -> dict:
        """Extra keyword arguments of `torch.distributed.init_process_group` for this device."""
        return {}

    def worker_bundle(self) -> dict[str, float]:
        """The Ray resources one worker on this device asks for."""
        bundle = {"CPU": 1.0}
        if self.gpus_per_worker:
            bundle["GPU"] = float(self.gpus_per_worker)
        return bundle

    def threads_per_worker(self, cpu_threads: int, workers: int) -> int | None:
        """Torch threads for each of `workers` workers on this device out of the host's
        `cpu_threads` (None: leave torch's default, the device does the work)."""
        return max(1, cpu_threads // workers) if self.shares_host_threads else None

    def warm_up_host_kernels(self, sample: bool) -> None:
        """Build (or load) the compiled CPU kernels now rather than in the first request's step:
        a fresh machine compiles them once (about a minute), and the host-side sampler uses them
        whatever the device or dtype (warns once and falls back where unavailable); `sample`: the
        structured-output mask kernels too (their own extension)."""
        from pagedserve.kernels import cpu_grammar, cpu_gemm

        cpu_gemm.kernel_available()
        if sample:
            cpu_grammar.available()
