"""MXFP4 weights (OCP microscaling FP4): gpt-oss's expert checkpoints, GGUF type MXFP4.

A block of 32 values shares one E8M0 scale (a byte e: 2^(e - 127)); each value is a 4-bit E2M1
code (0, .5, 1, 1.5, 2, 3, 4, 6, negative with bit 3). Two layouts of the same blocks:

- HF / OpenAI checkpoints (transformers' `integrations/mxfp4.py`): `<name>_blocks` uint8
  `[..., N, K / 32, 16]` -- byte j of a block holds values 2j (low nibble) and 2j + 1 (high) --
  and `<name>_scales` uint8 `[..., N, K / 32]` (the exponent bytes), for a weight `[..., N, K]`;
- ggml / GGUF (`block_mxfp4`, 17 bytes): the exponent byte, then 16 bytes whose byte j holds
  values j (low nibble) and j + 16 (high), as Q4_0.

The kernel (csrc/qlinear_mxfp4.h, `kernels.cpu_qlinear` format "mxfp4") reads ggml's rows; HF
blocks are repacked nibble by nibble at load (`hf_to_ggml_rows`: uint8 in, uint8 out, no float
copy). `pack_hf` writes HF's layout from float weights (tests build checkpoints with it).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from pagedserve.layers.weights import read_full

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def hf_to_ggml_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF blocks `[..., N, G, 16]` + scales `[..., N, G]` (uint8) -> ggml MXFP4 rows
    `[..., N, G * 17]` (uint8): per block the scale byte, then the codes re-paired (value j with
    value j + 16)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("MXFP4 blocks and scales must be uint8")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "([..., G, 16] and [..., G])")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32] in value order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., G, 16] ggml pairs
    rows = torch.cat((scales.unsqueeze(-1), packed), dim=-1)  # [..., G, 17]
    return rows.flatten(-2).contiguous()  # [..., G * 17]


def dequantize_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF blocks `[..., N, G, 16]` + scales `[..., N, G]` -> float32 `[..., N, G * 32]`."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = lut[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)  # [..., G, 32]
    return values.flatten(-2)


def pack_hf(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights `[..., N, K]` (K a multiple of 32) -> HF `(blocks, scales)`: per block of 32
    the exponent `floor(log2(amax)) - 2` (so amax / 2^e < 8: every value within E2M1's range, as
    gguf's quantizer), each value rounded to the nearest code."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 rows need a multiple of {BLOCK} values, got {w.shape[-1]}")
    wb = w.float().unflatten(-1, (w.shape[-1] // BLOCK, BLOCK))  # [..., G, 32]
    amax = wb.abs().amax(dim=-1)  # [..., G]
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    scaled = wb / torch.exp2(e).unsqueeze(-1)  # [..., G, 32]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), (e + 127).to(torch.uint8).contiguous()


# --- gpt-oss checkpoints -----------------------------------------------------------------------

def gpt_oss_expert_weights(weights: Iterable[tuple[str, Any]], *,
                           keep_blocks: bool = True) -> Iterator[tuple[str, Any]]:
    """gpt-oss checkpoint tensors with the experts in the MoE layer's layout (`layers.moe`):
    `experts.gate_up_proj` `[E, H, 2I]` -> `experts.gate_proj` / `experts.up_proj` `[E, I, H]`
    (even / odd columns), `experts.down_proj` `[E, I, H]` -> `[E, H, I]`, `gate_up_proj_bias`
    split likewise; MXFP4 `*_blocks` + `*_scales` -> `experts.<proj>` as ggml MXFP4 rows (`mxfp4_stack`:
    no float copy; `keep_blocks` False: dequantized to float32 instead, for models that cannot
    run them). Other tensors pass through."""
    pending: dict[str, dict[str, Any]] = {}
    for name, source in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts"):
            yield name, source
            continue
        if leaf in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            proj, kind = leaf.rsplit("_", 1)
            parts = pending.setdefault(f"{prefix}.{proj}", {})
            parts[kind] = read_full(source)
            if len(parts) == 2:
                del pending[f"{prefix}.{proj}"]
                for stacked_name, stack in _mxfp4_experts(prefix, proj, parts["blocks"], parts["scales"]):
                    yield stacked_name, stack if keep_blocks else stack.dequantize()
            continue
        if leaf == "gate_up_proj":
            t = read_full(source)  # [E, H, 2I]
            yield f"{prefix}.gate_proj", t[:, :, 0::2].transpose(1, 2).contiguous()  # [E, I, H]
            yield f"{prefix}.up_proj", t[:, :, 1::2].transpose(1, 2).contiguous()
        elif leaf == "gate_up_proj_bias":
            t = read_full(source)  # [E, 2I]
            yield f"{prefix}.gate_proj_bias", t[:, 0::2].contiguous()
            yield f"{prefix}.up_proj_bias", t[:, 1::2].contiguous()
        elif leaf == "down_proj":
            yield f"{prefix}.down_proj", read_full(source).transpose(1, 2).contiguous()  # [E, H, I]
        else:
            yield name, source
    if pending:
        raise ValueError(f"MXFP4 blocks without their scales (or scales without blocks): {sorted(pending)}")


def _mxfp4_experts(prefix: str, proj: str, blocks: torch.Tensor,
                   scales: torch.Tensor) -> Iterator[tuple[str, Any]]:
    """`gate_up_proj` blocks `[E, 2I, G, 16]` -> gate (even rows) and up (odd rows);
    `down_proj` blocks `[E, H, G, 16]` as they are: each as an `mxfp4_stack`."""
    if proj == "gate_up_proj":
        yield f"{prefix}.gate_proj", mxfp4_stack(hf_to_ggml_rows(blocks[:, 0::2], scales[:, 0::2]))
        yield f"{prefix}.up_proj", mxfp4_stack(hf_to_ggml_rows(blocks[:, 1::2], scales[:, 1::2]))
    else:
        yield f"{prefix}.down_proj", mxfp4_stack(hf_to_ggml_rows(blocks, scales))


GGML_TYPE_MXFP4 = 39  # gguf.GGMLQuantizationType.MXFP4


def mxfp4_stack(data: torch.Tensor):
    """Stacked expert weights `[E, N, K]` held as ggml MXFP4 rows `data` uint8 `[E, N, K / 32 *
    17]`: a 3-D `layers.quantization.QuantizedTensor` (kept as blocks where the parameter may
    be, else `dequantize()`d by `layers.weights.load_named_weights`)."""
    from pagedserve.layers.quantization import FORMATS, QuantizedTensor

    if data.dtype != torch.uint8 or data.dim() != 3 or data.shape[-1] % 17:
        raise ValueError(f"MXFP4 rows must be uint8 [E, N, G * 17], got {data.dtype} {tuple(data.shape)}")
    shape = (data.shape[0], data.shape[1], data.shape[2] // 17 * BLOCK)
    return QuantizedTensor(data, FORMATS["mxfp4"], shape, GGML_TYPE_MXFP4)
