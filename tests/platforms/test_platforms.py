"""The platform seam: one Platform per device chooses the attention backend, the layers' ops, graph
capture and memory profiling; models ask only the ops they were bound to."""

from __future__ import annotations

import pytest
import torch

import tiny
from utils import PagedRunner

from pagedserve.attention.backends.base import AttentionBatch
from pagedserve.attention.backends.torch_meta import TorchAttentionMetadata
from pagedserve.attention.backends.torch_ref import TorchAttentionBackend
from pagedserve.models.loader import load_model
from pagedserve.platforms import (
    CPU_OPS,
    TORCH_OPS,
    CpuPlatform,
    CudaPlatform,
    LayerOps,
    OpsUser,
    Platform,
    platform_for,
)


def test_platform_for_picks_the_class_from_the_device():
    assert type(platform_for("cpu")) is CpuPlatform
    assert type(platform_for(torch.device("cuda", 1))) is CudaPlatform
    assert platform_for("cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="meta"):
        platform_for("meta")


def test_each_platform_owns_its_choices():
    cpu, cuda = CpuPlatform(), CudaPlatform("cuda")
    from pagedserve.attention.backends import triton_available
    from pagedserve.platforms.cuda import CudaLayerOps

    assert cpu.ops is CPU_OPS
    # CUDA: Triton's norms and RoPE where triton imports, else torch's ops
    assert type(cuda.ops) is (CudaLayerOps if triton_available() else LayerOps)
    assert cpu.resolve_attention_backend("auto") == "torch"
    assert (cpu.pin_memory, cpu.can_profile_memory, cpu.is_host) == (False, False, True)
    assert (cuda.pin_memory, cuda.can_profile_memory, cuda.is_host) == (True, True, False)
    torch_backend = cuda.attention_backend("torch")
    assert not cpu.use_cuda_graphs(False, torch_backend)
    assert not cuda.use_cuda_graphs(False, torch_backend)  # host-side groups: no graphs
    with pytest.raises(ValueError, match="GPU memory profiling"):
        cpu.measure_peak_memory(lambda: None)
    with pytest.raises(ValueError, match="unknown attention backend"):
        cpu.attention_backend("flash")
    # the torch backend runs its platform's kernels
    assert cpu.attention_backend("torch").ops is CPU_OPS
    assert cuda.attention_backend("torch").ops is cuda.ops


def test_cuda_graphs_need_a_graph_safe_backend_and_no_enforce_eager():
    pytest.importorskip("triton")
    cuda = CudaPlatform("cuda")
    triton_backend = cuda.attention_backend("triton")
    assert cuda.use_cuda_graphs(False, triton_backend)
    assert not cuda.use_cuda_graphs(True, triton_backend)


class CountingOps(LayerOps):
    """Plain torch ops that count what the layers ask for."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def linear(self, x, weight, bias=None):
        self._count("linear")
        return super().linear(x, weight, bias)

    def activation(self, x, name):
        self._count("activation")
        return None

    def decoder_layer(self, layer, x, rope, kv_cache, meta):
        self._count("decoder_layer")
        return None

    def invariant_attention(self, *args):
        self._count("invariant_attention")
        return None


class CountingPlatform(Platform):
    def __init__(self):
        super().__init__("cpu")
        self.ops = CountingOps()


@torch.inference_mode()
def test_load_model_binds_the_platform_ops_into_every_layer():
    platform = CountingPlatform()
    config = tiny.config_for("llama")
    model = load_model(config, weights=None, dtype=torch.float32, seed=0, platform=platform)
    users = [m for m in model.modules() if isinstance(m, OpsUser)]
    assert users and all(m.ops is platform.ops for m in users)
    runner = PagedRunner(model)
    runner.step([(0, [1, 2, 3]), (1, [4, 5])])
    calls = platform.ops.calls
    layers = config.num_hidden_layers
    # q, k, v, o, gate, up, down per layer, and the LM head: every product asked the platform
    assert calls["linear"] >= 7 * layers and calls["decoder_layer"] == layers
    assert calls["activation"] == layers
    # the platform's plain ops give what the CPU kernels give, up to rounding
    ref = PagedRunner(load_model(config, weights=None, dtype=torch.float32, seed=0))
    mine = PagedRunner(model)
    for a, b in zip(mine.step([(0, [1, 2, 3])]), ref.step([(0, [1, 2, 3])])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_metadata_remembers_the_backend_that_built_it_and_layers_call_it():
    calls = []

    class Recording(TorchAttentionBackend):
        def forward(self, *args, **kwargs):
            calls.append(1)
            return super().forward(*args, **kwargs)

    backend = Recording(ops=TORCH_OPS)
    meta = backend.build_metadata(AttentionBatch(block_tables=[[0]], seq_lens=[2],
                                                 query_lens=[2], block_size=4, null_block=3))
    assert meta.impl is backend and isinstance(meta, TorchAttentionMetadata)
    from pagedserve.layers.attention import PagedAttention

    attn = PagedAttention(2, 1, 8, 0.5)
    cache = (torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8))
    out = attn(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8), cache, meta)
    assert calls == [1] and out.shape == (2, 16)


def test_workers_ask_the_platform_for_threads_bundles_and_the_process_group():
    from pagedserve.platforms import default_device

    cpu, cuda = CpuPlatform(), CudaPlatform("cuda:1")
    assert (cpu.dist_backend, cuda.dist_backend) == ("gloo", "nccl")
    assert cpu.process_group_options() == {}
    assert cuda.process_group_options() == {"device_id": torch.device("cuda", 1)}
    assert cpu.worker_bundle() == {"CPU": 1.0}
    assert cuda.worker_bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert cpu.threads_per_worker(8, 3) == 2 and cpu.threads_per_worker(2, 4) == 1
    assert cuda.threads_per_worker(8, 3) is None  # the GPU does the work: torch's default
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_cpu_worker_keeps_freed_step_buffers_in_the_heap():
    """glibc: after a CPU worker's setup, a freed 16 MiB buffer (a prompt step's size) comes from
    the heap, not from a fresh mmap that the next step would fault in again page by page."""
    import ctypes
    import ctypes.util

    from pagedserve.platforms.cpu import CpuPlatform

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    CpuPlatform().worker_device()
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(16 << 20)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(p)
    assert p and mapped == 0
