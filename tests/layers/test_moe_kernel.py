"""The routed experts in one compiled call (kernels/cpu_moe.py, csrc/moe.cpp) against the layer's
own loop over experts (layers/moe.py) on the same kernels: bit for bit, for the weight formats
GGUF MoE files hold (Q4_K gate / up with a Q6_K down as Q4_K_M writes them, Q8_0, Q5_0, MXFP4),
INT8 and bf16, bf16 and float32 x, token counts on both sides of the 8-bit GEMM's threshold, at
every ISA level this machine has; and a token's bits independent of its batch with
batch-invariant weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedserve.distributed.tp import TPContext
from pagedserve.kernels import cpu_fp32, cpu_gemm
from pagedserve.kernels.cpu_isa import ISA_ENV, ISA_LEVELS
from pagedserve.kernels.cpu_qlinear import FORMATS, QuantSpec, quantize_int8, quantized_available, set_quant
from pagedserve.layers.moe import ExpertPlacement, MoEExperts
from pagedserve.platforms.cpu import CPU_OPS, CpuOps

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (quantized_available() and cpu_fp32.fp32_kernels_available()),
    reason="compiled CPU kernels unavailable")

H, I, E, K = 256, 256, 4, 2
GGML = {"q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "mxfp4": Q.MXFP4}
_K_SCALES = {"q4_k": (0, 2), "q6_k": (208,)}  # byte offsets of a K-quant block's fp16 scales


class _LoopOps(CpuOps):
    """The CPU ops without the fused experts: the layer's loop over experts."""

    def moe_experts(self, experts, x, weights, ids, down_bias):
        return None


LOOP = _LoopOps()


def _stack(fmt: str, n: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """E experts' weights [E, n, ...] in `fmt`, stacked as a GGUF file's `ffn_*_exps`."""
    rng = np.random.default_rng(seed)
    if fmt == "bf16":
        return torch.from_numpy(rng.standard_normal((E, n, k)).astype(np.float32) * 0.05).to(torch.bfloat16)
    if fmt == "int8":
        rows = quantize_int8(torch.from_numpy(rng.standard_normal((E * n, k)).astype(np.float32) * 0.05))
        return set_quant(rows.view(E, n, -1), dataclasses.replace(rows.quant, dtype=dtype))
    if fmt in _K_SCALES:  # gguf cannot quantize K-quants: random blocks with small scales are valid
        _, block_bytes = GGML_QUANT_SIZES[GGML[fmt]]
        raw = rng.integers(0, 256, size=(E * n, k // 256, block_bytes), dtype=np.uint8)
        for off in _K_SCALES[fmt]:
            scales = (rng.random((E * n, k // 256)) * 0.004 + 0.001).astype(np.float16)
            raw[..., off:off + 2] = scales.view(np.uint8).reshape(E * n, k // 256, 2)
    else:
        raw = quantize(rng.standard_normal((E * n, k)).astype(np.float32) * 0.05, GGML[fmt])
    w = torch.from_numpy(np.ascontiguousarray(raw)).view(E, n, -1)
    return set_quant(w, QuantSpec(FORMATS[fmt], k, dtype))


def _experts(formats: tuple[str, str, str], dtype, *, act="silu", bias=False,
             placement: ExpertPlacement | None = None, seed=0) -> MoEExperts:
    placement = placement or ExpertPlacement(E)
    m = MoEExperts(H, I, placement, act=act, bias=bias)
    for i, (name, n, k) in enumerate((("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I))):
        w = _stack(formats[i], n, k, seed + i, dtype)
        param = torch.nn.Parameter(w, requires_grad=False)
        if hasattr(w, "quant"):  # as layers.quantization.install_quantized marks it
            param.quant = w.quant
        setattr(m, name, param)
    if bias:
        gen = torch.Generator().manual_seed(seed)
        for b in (m.gate_proj_bias, m.up_proj_bias, m.down_proj_bias):
            b.data = (torch.randn(b.shape, generator=gen) * 0.1).to(dtype)
            b.requires_grad_(False)
    return m


def _route(t: int, num_experts: int = E, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(t)])  # [T, k]
    weights = torch.softmax(torch.randn(t, K, generator=gen), -1)
    return weights, ids


def _fused_and_loop(m: MoEExperts, x, weights, ids, down_bias=True):
    m.ops = CPU_OPS
    fused = CPU_OPS.moe_experts(m, x, weights, ids, down_bias)
    assert fused is not None, "the fused experts did not apply"
    m.ops = LOOP
    loop = m(x, weights, ids, down_bias=down_bias)
    m.ops = CPU_OPS
    return fused, loop


@pytest.fixture(params=list(ISA_LEVELS))
def isa(request, monkeypatch) -> int:
    level = ISA_LEVELS[request.param]
    if level > int(torch.ops.pagedserve_cpu.cpu_isa()):
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv(ISA_ENV, request.param)
    assert cpu_gemm.linear_isa() == level
    return level


CASES = [  # (gate, up, down formats), x dtype
    (("q4_k", "q4_k", "q6_k"), torch.bfloat16),
    (("q8_0", "q8_0", "q5_0"), torch.bfloat16),
    (("mxfp4", "mxfp4", "mxfp4"), torch.bfloat16),
    (("int8", "int8", "int8"), torch.bfloat16),
    (("bf16", "bf16", "bf16"), torch.bfloat16),
    (("q4_k", "q4_k", "q6_k"), torch.float32),
]


@torch.no_grad()
@pytest.mark.parametrize("formats,dtype", CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v)[6:])
def test_fused_experts_equal_the_layers_loop_bit_for_bit(formats, dtype, isa):
    m = _experts(formats, dtype)
    for t in (1, 5, 64):  # 64 tokens over 4 experts: every expert past the 8-bit GEMM's threshold
        weights, ids = _route(t, seed=t)
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
        fused, loop = _fused_and_loop(m, x, weights, ids)
        assert fused.dtype is torch.float32 and fused.shape == (t, H)
        assert torch.equal(fused, loop), f"{t} tokens: max diff {(fused - loop).abs().max()}"


@torch.no_grad()
def test_biases_gelu_and_expert_parallel_ranks_equal_the_loop():
    """Expert biases (down's only where asked), tanh-GELU, and rank 1 of 2 under expert
    parallelism (its experts 4..7; tokens routed elsewhere get nothing from it)."""
    m = _experts(("q8_0", "q8_0", "q8_0"), torch.bfloat16, act="gelu_pytorch_tanh", bias=True)
    weights, ids = _route(9)
    x = torch.randn(9, H).to(torch.bfloat16)
    for down_bias in (True, False):
        fused, loop = _fused_and_loop(m, x, weights, ids, down_bias)
        assert torch.equal(fused, loop)
    ep = ExpertPlacement(2 * E, TPContext(rank=1, world_size=2), expert_parallel=True)
    m = _experts(("q4_k", "q4_k", "q6_k"), torch.bfloat16, placement=ep)
    weights, ids = _route(12, num_experts=2 * E)
    fused, loop = _fused_and_loop(m, x.repeat(2, 1)[:12], weights, ids)
    assert torch.equal(fused, loop)
    none_here = (ids < E).all(dim=1)  # tokens whose experts are all on rank 0
    assert none_here.any() and (fused[none_here] == 0).all() and (fused[~none_here] != 0).any()


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpt_oss_clamped_swiglu_over_mxfp4_equals_the_loop(dtype):
    """gpt-oss's experts (models.gpt_oss.ClampedSwiGLU with biases, MXFP4 blocks as its GGUF /
    checkpoint holds them) in the one call; x large enough that both clamps engage."""
    from pagedserve.models.gpt_oss import ClampedSwiGLU

    act = ClampedSwiGLU(1.702, 7.0)
    m = _experts(("mxfp4", "mxfp4", "mxfp4"), dtype, act=act, bias=True)
    act.ops = CPU_OPS
    for t in (3, 40):
        weights, ids = _route(t, seed=t)
        x = (torch.randn(t, H, generator=torch.Generator().manual_seed(t)) * 12).to(dtype)
        fused, loop = _fused_and_loop(m, x, weights, ids)
        assert torch.equal(fused, loop), f"{t} tokens: max diff {(fused - loop).abs().max()}"
    gate = CPU_OPS.linear(x, m.expert_weight("gate_proj", 0), m.gate_proj_bias[0])
    up = CPU_OPS.linear(x, m.expert_weight("up_proj", 0), m.up_proj_bias[0])
    assert (gate > 7).any() and (up.abs() > 7).any()  # the clamps mattered


@torch.no_grad()
def test_a_tokens_result_does_not_depend_on_its_batch_with_batch_invariant_weights():
    """`--batch-invariant` (QuantSpec.batch_invariant): every expert runs the 8-bit GEMV at any
    row count, so a token's bits are the same alone, reversed and among 40 others; without it an
    expert's 8-bit GEMM (from 8 rows) rounds differently (the check can fail)."""
    m = _experts(("q4_k", "q4_k", "q6_k"), torch.bfloat16)
    weights, ids = _route(41)
    x = torch.randn(41, H).to(torch.bfloat16)
    plain = CPU_OPS.moe_experts(m, x, weights, ids, True)
    for p in (m.gate_proj, m.up_proj, m.down_proj):
        p.quant = dataclasses.replace(p.quant, batch_invariant=True)
    full = CPU_OPS.moe_experts(m, x, weights, ids, True)
    assert not torch.equal(plain, full)  # the GEMM ran without the flag
    assert torch.equal(CPU_OPS.moe_experts(m, x.flip(0), weights.flip(0), ids.flip(0), True).flip(0), full)
    for i in range(41):
        alone = CPU_OPS.moe_experts(m, x[i:i + 1], weights[i:i + 1], ids[i:i + 1], True)
        assert torch.equal(alone[0], full[i]), f"token {i}"


@torch.no_grad()
def test_the_loop_runs_where_the_kernel_does_not_apply():
    """fp32 weights (the fp32 extension's products), a custom activation: None, the loop runs."""
    m = MoEExperts(H, I, ExpertPlacement(E))
    for p in m.parameters():
        p.requires_grad_(False).normal_(0, 0.05)
    weights, ids = _route(3)
    x = torch.randn(3, H)
    assert CPU_OPS.moe_experts(m, x, weights, ids, True) is None
    custom = MoEExperts(H, I, ExpertPlacement(E), act=lambda g, u: g * u)
    assert CPU_OPS.moe_experts(custom, x, weights, ids, True) is None


def _with_orders(m: MoEExperts, seed: int, up_seed: int | None = None) -> None:
    """Give each expert its own input order (GPTQ act-order stacks: `QuantSpec.perm` `[E, K]`);
    gate and up share theirs unless `up_seed` differs."""
    def orders(k: int, s: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(s)
        return torch.stack([torch.randperm(k, generator=gen) for _ in range(E)])  # [E, K]

    for name, k, s in (("gate_proj", H, seed), ("up_proj", H, seed if up_seed is None else up_seed),
                       ("down_proj", I, seed + 1)):
        p = getattr(m, name)
        p.quant = dataclasses.replace(p.quant, perm=orders(k, s))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_each_experts_own_input_order_is_gathered_as_the_loop_gathers_it(dtype, isa):
    """GPTQ act-order experts (each stack's rows hold an expert's input features in its own
    order): the kernel gathers x's features for gate / up, and h's for down, per expert, and
    equals the loop (whose products gather them by `QuantSpec.perm`) bit for bit; the orders
    change the result (so they are not ignored)."""
    plain = _experts(("q8_0", "q8_0", "q5_0"), dtype)
    m = _experts(("q8_0", "q8_0", "q5_0"), dtype)
    _with_orders(m, seed=3)
    for t in (1, 5, 64):
        weights, ids = _route(t, seed=t)
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
        fused, loop = _fused_and_loop(m, x, weights, ids)
        assert torch.equal(fused, loop), f"{t} tokens: max diff {(fused - loop).abs().max()}"
        assert not torch.equal(fused, _fused_and_loop(plain, x, weights, ids)[0])


@torch.no_grad()
def test_gate_and_up_in_different_orders_run_the_loop_and_a_bad_order_is_refused():
    m = _experts(("q8_0", "q8_0", "q5_0"), torch.bfloat16)
    _with_orders(m, seed=3, up_seed=9)
    weights, ids = _route(5)
    x = torch.randn(5, H).to(torch.bfloat16)
    assert CPU_OPS.moe_experts(m, x, weights, ids, True) is None
    _with_orders(m, seed=3)
    m.down_proj.quant.perm[:, 0] = I  # past the last feature
    with pytest.raises(RuntimeError, match="perm names feature"):
        CPU_OPS.moe_experts(m, x, weights, ids, True)
