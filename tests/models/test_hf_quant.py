"""HF quantized checkpoints (AWQ, GPTQ, compressed-tensors) kept packed: tiny Llama checkpoints
written here with the quantizers' own packing rules (AutoAWQ's WQLinear_GEMM, AutoGPTQ /
GPTQModel's QuantLinear.pack with v1 zeros, compressed-tensors' pack_to_int32), loaded with
`LLM(path)` and compared against the dequantized weights in float32.

NOTE: the packers below are written from the quantizers' loops (not from layers.hf_quant), so a
wrong nibble order or zero offset on either side shows up as a mismatch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils import assert_tie_rule, ours_as_pairs

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu_moe import moe_experts
from pagedserve.kernels.cpu_qlinear import quantized_available
from pagedserve.platforms import cpu as cpu_platform

pytestmark = pytest.mark.skipif(not quantized_available(), reason="needs the compiled CPU kernels")

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 words a checkpoint stores (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantize(w: torch.Tensor, groups: torch.Tensor, sym: bool):
    """Group-wise 4-bit (GPTQ's quantizer: the range always spans 0): codes [N, K], zeros and
    fp16 scales [G, N], and the dequantized float32 weights [N, K]."""
    n, k = w.shape
    g_count = int(groups.max()) + 1
    scales = torch.empty(g_count, n, dtype=torch.float16)
    zeros = torch.empty(g_count, n, dtype=torch.int64)
    for g in range(g_count):
        cols = w[:, groups == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / 15).to(torch.float16)
        scales[g] = s
        zeros[g] = torch.full_like(lo, 8, dtype=torch.int64) if sym else torch.round(-lo / s.float()).long()
    s_k, z_k = scales.float()[groups].t(), zeros[groups].t()  # [N, K]
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, 15).long()
    return q, zeros, scales, (q - z_k).float() * s_k


def _pack_awq(q: torch.Tensor, zeros: torch.Tensor):
    """AutoAWQ's WQLinear_GEMM.from_linear: intweight [K, N], 8 columns per int32 in AWQ_ORDER."""
    def pack(cols: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8]
        out = torch.zeros(cols.shape[0], cols.shape[1] // 8, dtype=torch.int64)
        for col in range(cols.shape[1] // 8):
            for i in range(8):
                out[:, col] |= cols[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return _to_int32(out)

    return pack(q.t().contiguous()), pack(zeros)


def _pack_gptq(q: torch.Tensor, zeros: torch.Tensor):
    """AutoGPTQ's QuantLinear.pack (v1): 8 rows of intweight [K, N] per int32 row; zeros less one,
    8 columns per int32."""
    intweight = q.t().contiguous()
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    z = (zeros - 1) & 0xF
    qzeros = torch.zeros(z.shape[0], z.shape[1] // 8, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= z[:, col * 8 + j] << (4 * j)
    return _to_int32(qweight), _to_int32(qzeros)


def _quantize8(w: torch.Tensor):
    """Per-channel symmetric 8-bit: codes [N, K] (-128..127), bf16 scales [N, 1], values."""
    s = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
    q = torch.clamp(torch.round(w / s.float()), -128, 127).long()
    return q, s, q.float() * s.float()


def _pack_ct(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' pack_to_int32: signed values + 2^(bits - 1), 32 / bits per int32 along
    `dim`, value i of a word in its bits bits * i."""
    pf, unsigned = 32 // bits, values + (1 << (bits - 1))
    if dim == 0:
        return _pack_ct(values.t(), bits).t().contiguous()
    out = torch.zeros(values.shape[0], values.shape[1] // pf, dtype=torch.int64)
    for i in range(pf):
        out |= unsigned[:, i::pf] << (bits * i)
    return _to_int32(out)


def _quantize_fp8(w: torch.Tensor, bn: int, bk: int):
    """DeepSeek V3's block FP8: per [bn, bk] tile scale_inv = amax / 448, the tile's values
    w / scale_inv as E4M3 -> (float8 weight [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)],
    the dequantized values)."""
    n, k = w.shape
    tn, tk = -(-n // bn), -(-k // bk)
    scale_inv = torch.empty(tn, tk, dtype=torch.float32)
    for i in range(tn):
        for j in range(tk):
            scale_inv[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
    full = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
    w8 = (w / full).to(torch.float8_e4m3fn)
    return w8, scale_inv, w8.float() * full


def _write(base, tmp_path, method: str, sym: bool = False, act_order: bool = False, bits: int = 4,
           block: tuple[int, int] = (128, 128)):
    """The quantized checkpoint and its dequantized float32 twin, from the tiny Llama at `base`."""
    tensors = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    packed, dense, orders = {}, {}, {}
    for name, w in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in PROJS:
            packed[name] = dense[name] = w
            continue
        k = w.shape[1]
        groups = torch.arange(k) // GROUP
        if act_order:  # GPTQ's desc_act: groups over a permuted order, g_idx = invperm // group
            # one order per input (GPTQ's comes from the input's statistics): q / k / v share
            # theirs, as do an MLP's (or an expert's) gate and up
            proj = prefix.rpartition(".")[2]
            shared = proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
            key = (prefix.rpartition(".")[0], "in" if shared else proj)
            if key not in orders:
                orders[key] = torch.argsort(torch.randperm(k, generator=gen))
            groups = orders[key] // GROUP
        if method == "fp8":
            w8, scale_inv, values = _quantize_fp8(w.float(), *block)
            dense[name] = values
            packed.update({name: w8, f"{prefix}.weight_scale_inv": scale_inv})
            continue
        if bits == 8:
            q, scales, values = _quantize8(w.float())
            dense[name] = values
            packed.update({f"{prefix}.weight_packed": _pack_ct(q, 8), f"{prefix}.weight_scale": scales,
                           f"{prefix}.weight_shape": torch.tensor(list(w.shape))})
            continue
        q, zeros, scales, values = _quantize(w.float(), groups, sym)
        dense[name] = values
        if method == "compressed-tensors":  # signed codes q - 8, zero points z - 8, scales [N, G]
            packed.update({f"{prefix}.weight_packed": _pack_ct(q - 8, 4),
                           f"{prefix}.weight_scale": scales.t().contiguous(),
                           f"{prefix}.weight_shape": torch.tensor(list(w.shape))})
            if not sym:
                packed[f"{prefix}.weight_zero_point"] = _pack_ct(zeros.t() - 8, 4, dim=0)
            if act_order:
                packed[f"{prefix}.weight_g_idx"] = groups.to(torch.int32)
            continue
        if method == "awq":
            qweight, qzeros = _pack_awq(q, zeros)
        else:
            qweight, qzeros = _pack_gptq(q, zeros)
            packed[f"{prefix}.g_idx"] = groups.to(torch.int32)
        packed.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                       f"{prefix}.scales": scales})
    qconfig = {"quant_method": method, "bits": 4, "group_size": GROUP}
    qconfig.update({"zero_point": True, "version": "gemm"} if method == "awq" else
                   {"sym": sym, "desc_act": act_order, "checkpoint_format": "gptq"})
    if method == "fp8":
        qconfig = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(block)}
    if method == "compressed-tensors":
        scheme = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                  "strategy": "channel" if bits == 8 else "group", "group_size": None if bits == 8 else GROUP,
                  "actorder": "group" if act_order else None}
        qconfig = {"quant_method": method, "format": "pack-quantized", "ignore": ["lm_head"],
                   "quantization_status": "compressed",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                                 "input_activations": None}}}
    folders = {}
    for kind, weights in (("packed", packed), ("dense", dense)):
        folder = tmp_path / f"{method}-{kind}"
        shutil.copytree(base, folder)
        save_file({n: t.contiguous() for n, t in weights.items()}, str(folder / "model.safetensors"))
        if kind == "packed":
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = qconfig
            (folder / "config.json").write_text(json.dumps(config))
        folders[kind] = folder
    return folders["packed"], folders["dense"], dense


PROMPTS = [[1, 17, 250, 3, 99, 402, 64], [1, 480, 22, 22, 190, 7, 301, 45, 12]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)


def _run(path, **kw):
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22, **kw)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return llm, [ours_as_pairs(o.outputs[0]) for o in out]


CASES = {  # id: (method, sym, act_order, bits, FP8 block)
    "awq": ("awq", False, False, 4, None),
    "gptq-sym-act-order": ("gptq", True, True, 4, None),
    "gptq-asym": ("gptq", False, False, 4, None),
    "ct-w4a16-sym": ("compressed-tensors", True, False, 4, None),
    "ct-w4a16-asym-act-order": ("compressed-tensors", False, True, 4, None),
    "ct-w8a16-channel": ("compressed-tensors", True, False, 8, None),
    "fp8-block-128": ("fp8", True, False, 8, (128, 128)),
    "fp8-block-32x64": ("fp8", True, False, 8, (32, 64)),  # several tiles per matrix, not square
}
# the cases also generated with (the others: unpacked values only, to keep the test time small)
RUN = ("awq", "gptq-sym-act-order", "ct-w8a16-channel", "fp8-block-128")
FORMAT = {"awq": "q4_z", "gptq": "q4_z", "compressed-tensors": "q4_z", "fp8": "f8_e4m3"}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_checkpoint_matches_its_dequantized_float32_model(case, checkpoints, tmp_path):
    """The packed layers' values are exactly the quantizer's (dequantized); for the RUN cases,
    `LLM(path)` keeps them as rows of their format (`--quantization` picked from config.json) and
    generates the float32 reference's greedy tokens (vLLM's near-tie rule: the tiny random model's
    top logprobs lie within a few hundredths), with logprobs within 5% of the position's largest
    (the GGUF tests' bound for the 8-bit activations' rounding)."""
    from pagedserve.layers.hf_quant import hf_quantized_weights
    from pagedserve.models.loader import iter_safetensors
    from pagedserve.models.source import resolve_model

    method, sym, act_order, bits, block = CASES[case]
    packed, dense, values = _write(checkpoints("llama"), tmp_path, method, sym, act_order, bits,
                                   block or (128, 128))
    config = resolve_model(str(packed)).config
    unpacked = dict(hf_quantized_weights(iter_safetensors(packed), config, method, keep=False))
    for name, want in values.items():
        assert torch.equal(unpacked[name], want), name
    if case not in RUN:
        return

    llm, ours = _run(packed)
    model = llm.engine.executor.model
    specs = [m.weight.quant for name, m in model.named_modules() if name.rpartition(".")[2] in PROJS]
    assert len(specs) == 2 * len(PROJS)
    fmt = "q8_f" if method == "compressed-tensors" and bits == 8 else FORMAT[method]
    assert all(s.format.name == fmt for s in specs)
    assert any(s.perm is not None for s in specs) == act_order
    ref = _run(dense)[1]
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_tie_rule(a, b, f"prompt {i}")
        for pos, (lp, rlp) in enumerate(zip(a[1], b[1])):
            tol = 0.05 * max(abs(v) for v in rlp.values())
            for t in set(lp) & set(rlp):
                assert abs(lp[t] - rlp[t]) <= tol, f"prompt {i} position {pos} token {t}: {lp[t]} vs {rlp[t]}"
            if a[0][pos] != b[0][pos]:
                break


def test_awq_flag_on_an_unquantized_checkpoint_names_the_parameter(checkpoints):
    with pytest.raises(ValueError, match="quantization='awq'"):
        LLM(str(checkpoints("llama")), dtype="float32", quantization="awq")


def test_the_flag_choices_are_the_loaders_methods():
    from pagedserve.config import QUANTIZATIONS
    from pagedserve.layers import quantization

    assert QUANTIZATIONS == quantization.QUANTIZATIONS


MOE_CASES = {  # id: (method, sym, act_order, FP8 block): packed experts of a Qwen3-MoE checkpoint
    "awq": ("awq", False, False, None),
    "gptq-sym-act-order": ("gptq", True, True, None),
    "fp8-block-32x64": ("fp8", True, False, (32, 64)),
}
EXPERTS = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_packed_moe_experts_stay_packed_and_match_the_dequantized_model(case, checkpoints, tmp_path, monkeypatch):
    """An MoE checkpoint quantized expert by expert (`...experts.<e>.gate_proj.qweight`, ...) keeps
    each layer's experts as one uint8 stack `[E, N, row_bytes]` of the checkpoint's format (no
    float copy), and generates the float32 reference's greedy tokens by the tie rule. GPTQ
    act-order gives every expert its own input order: the gate / up stacks (K = 64: two groups,
    shuffled) keep one order per expert (`QuantSpec.perm` `[E, K]`, not all alike); the down
    stacks (K = 32: one group, nothing to reorder) have none. An expert's gate and up share
    their order (as GPTQ's come from the same input), and the experts run the fused kernel."""
    method, sym, act_order, block = MOE_CASES[case]
    packed, dense, _ = _write(checkpoints("qwen3_moe"), tmp_path, method, sym, act_order,
                              block=block or (128, 128))
    fused = []
    monkeypatch.setattr(cpu_platform, "moe_experts", lambda *a: fused.append(moe_experts(*a)) or fused[-1])
    llm, ours = _run(packed)
    assert fused and all(f is not None for f in fused), "the experts ran the fused kernel"
    model = llm.engine.executor.model
    stacks = [getattr(m, n) for name, m in model.named_modules() if name.endswith("mlp.experts")
              for n in EXPERTS]
    assert len(stacks) == 2 * len(EXPERTS)
    assert all(w.dtype is torch.uint8 and w.dim() == 3 and w.shape[0] == 8 for w in stacks)
    assert {w.quant.format.name for w in stacks} == {FORMAT[method]}
    for i, (w, n) in enumerate(zip(stacks, EXPERTS * 2)):
        perm = w.quant.perm
        if act_order and n != "down_proj":
            assert perm is not None and perm.shape == (8, 64)
            assert all(sorted(p.tolist()) == list(range(64)) for p in perm)
            assert len({tuple(p.tolist()) for p in perm}) > 1, "every expert has its own order"
            if n == "up_proj":
                assert torch.equal(perm, stacks[i - 1].quant.perm)
        else:
            assert perm is None
    ref = _run(dense)[1]
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_tie_rule(a, b, f"prompt {i}")
