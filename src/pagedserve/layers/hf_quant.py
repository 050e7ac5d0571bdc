"""HF quantized checkpoints kept packed (CPU): AWQ, GPTQ and compressed-tensors integer weights
and block-scaled FP8, converted losslessly into rows of the kernel's formats (csrc/qformats.h:
Q4_Z, Q8_F, F8_E4M3; their block routines in csrc/qlinear_blocks.h). The integer ones run on the
same 8-bit-activation kernels as the ggml blocks; FP8 values are not integers times one scale, so
F8_E4M3 rows are dequantized tile by tile and multiplied with x as it is.

A checkpoint says how it was quantized in its config.json (`quantization_config.quant_method`).
Each quantized linear layer `<p>` stores, instead of (or beside) `<p>.weight` `[N, K]`:

- AWQ (AutoAWQ's GEMM packing, `version: "gemm"`): `<p>.qweight` int32 `[K, N / 8]`: word
  `[k, c]` holds the codes of columns `8 c + AWQ_ORDER[i]` in its nibbles i (bits 4 i..4 i + 3);
  `<p>.qzeros` int32 `[K / g, N / 8]` packed the same way; `<p>.scales` fp16 `[K / g, N]`.
  value `[n, k]` = (q - z) * s of group k // g.
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq", the v1 layout vLLM reads):
  `<p>.qweight` int32 `[K / 8, N]`: word `[r, n]` holds rows `8 r + i` in nibbles i;
  `<p>.qzeros` int32 `[G, N / 8]`: word `[g, c]` holds columns `8 c + i` in nibbles i, each the
  zero point less one (so an asymmetric zero of 0 is stored as 15 and reads back as 16, as
  every GPTQ kernel reads it; "gptq_v2" stores z itself); `<p>.scales` fp16 `[G, N]`;
  `<p>.g_idx` int32 `[K]`: the group of each input feature (k // g, or any order with act-order,
  `desc_act`). value `[n, k]` = (q - z) * s of group g_idx[k].
- compressed-tensors, `format: "pack-quantized"` (W4A16 / W8A16, llm-compressor's output):
  `<p>.weight_packed` int32 `[N, K * bits / 32]` (`pack_to_int32`: value `w * 32 / bits + i`
  of a row in bits `bits * i`, stored as q + 2^(bits - 1)); `<p>.weight_scale` `[N, G]`;
  optional `<p>.weight_zero_point` int32 `[N * bits / 32, G]` (packed along N, offset the same
  way) and `<p>.weight_g_idx` `[K]`; `<p>.weight_shape` `[N, K]`. value = (q - zp) * scale.
- FP8 (`quant_method: "fp8"`, `weight_block_size` [bn, bk], DeepSeek V3's and Qwen3's FP8
  checkpoints): `<p>.weight` float8_e4m3fn `[N, K]` and `<p>.weight_scale_inv` float32
  `[ceil(N / bn), ceil(K / bk)]`; value = weight * the scale of its tile.

Q4_Z holds blocks of 32 values along K with one fp32 scale and one integer zero point: exactly
a group's (s, z) when a block lies inside one group (4-bit AWQ, GPTQ, compressed-tensors);
Q8_F 32 int8 with one fp32 scale (8-bit symmetric compressed-tensors); F8_E4M3 32 E4M3 bytes
with their tile's scale. With act-order the input features are sorted by group
(`QuantizedTensor.perm`, the order the rows are stored in; the product gathers x's features in
that order first, `kernels.cpu_qlinear.QuantSpec.perm`), so every group is a run of whole
blocks; a group whose size is not a multiple of 32 is refused.

`hf_quantized_weights(weights, config, method)` turns a checkpoint's tensors into `<p>.weight`
`layers.quantization.QuantizedTensor`s (kept as rows where the parameter may be, else
dequantized by `layers.weights.load_named_weights`); other tensors pass through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from pagedserve.layers.quantization import FORMATS, HF_QUANTIZATIONS, QuantizedTensor
from pagedserve.layers.weights import read_full

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's nibble i holds column AWQ_ORDER[i] of its 8
BLOCK = 32  # values per Q4_Z block

_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                                 "weight_g_idx")}
_PARTS["fp8"] = ("weight", "weight_scale_inv")  # "weight": an FP8 tensor's only (see _is_fp8)
# the parts a layer cannot do without (the others: present or not, all read before the layer ends)
_NEEDED = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
           "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
           "fp8": ("weight", "weight_scale_inv")}


def checkpoint_method(config: Any) -> str | None:
    """The `quant_method` of an HF config's `quantization_config` (lower-cased), None for none."""
    qc = _qconfig(config)
    method = qc.get("quant_method") if qc else None
    return str(method).lower() if method else None


def _qconfig(config: Any) -> dict | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None and hasattr(config, "get_text_config"):
        qc = getattr(config.get_text_config(), "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return qc


@dataclass(frozen=True)
class HFQuantConfig:
    """What a checkpoint's `quantization_config` says about its packed weights (compressed-tensors:
    nothing more; each layer's bits and groups are read from its tensors)."""

    method: str  # one of HF_QUANTIZATIONS
    bits: int = 4
    group_size: int = 0  # AWQ / GPTQ: -1 for one group over all of K; fp8: a scale tile's columns
    zero_offset: int = 0  # added to the stored zero points (GPTQ v1: 1)
    block_rows: int = 0  # fp8: a scale tile's rows

    @classmethod
    def from_config(cls, config: Any, method: str) -> "HFQuantConfig":
        """Read `config.quantization_config` for `method`; ValueError naming `quantization` when
        the checkpoint is not of that method or uses a packing we do not read."""
        qc = _qconfig(config)
        found = checkpoint_method(config)
        if found != method:
            raise ValueError(f"quantization={method!r} needs a checkpoint whose config.json "
                             f"quantization_config.quant_method is {method!r}, got {found!r}")
        if method == "fp8":
            block = qc.get("weight_block_size")
            fmt = str(qc.get("fmt", "e4m3")).lower()
            if fmt != "e4m3" or not block or len(block) != 2 or int(block[1]) % BLOCK:
                raise ValueError("quantization='fp8': block-scaled E4M3 weights are read "
                                 f"(weight_block_size [n, k], k a multiple of {BLOCK}); got fmt "
                                 f"{fmt!r}, weight_block_size {block!r}")
            return cls(method, 8, group_size=int(block[1]), block_rows=int(block[0]))
        if method == "compressed-tensors":
            fmt = str(qc.get("format", "")).lower()
            if fmt != "pack-quantized":
                raise ValueError(f"quantization='compressed-tensors': only the pack-quantized format "
                                 f"is read, got {fmt!r}")
            for name, group_cfg in (qc.get("config_groups") or {}).items():
                w = group_cfg.get("weights") or {}
                if group_cfg.get("input_activations"):
                    raise ValueError(f"quantization='compressed-tensors': {name} quantizes activations "
                                     "(weight-only schemes, W4A16 / W8A16, are read)")
                if w.get("type", "int") != "int" or int(w.get("num_bits", 4)) not in (4, 8):
                    raise ValueError(f"quantization='compressed-tensors': {name}'s weights must be int "
                                     f"4 or 8 bits, got {w.get('type')} {w.get('num_bits')}")
            return cls(method)
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if bits != 4:
            raise ValueError(f"quantization={method!r}: {bits}-bit weights are not supported (4-bit only)")
        if group != -1 and (group <= 0 or group % BLOCK):
            raise ValueError(f"quantization={method!r}: group_size must be -1 or a multiple of "
                             f"{BLOCK}, got {group}")
        offset = 0
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"quantization='awq': only AutoAWQ's GEMM packing is read, got version {version!r}")
            if not qc.get("zero_point", True):
                raise ValueError("quantization='awq': checkpoints without zero points are not supported")
        else:
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"quantization='gptq': checkpoint_format {fmt!r} is not read "
                                 "(gptq, gptq_v2)")
            offset = 1 if fmt == "gptq" else 0
        return cls(method, bits, group, offset)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words `[..., W]` -> their 8 nibbles `[..., W, 8]` (uint8, nibble i = bits 4i..4i+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM words -> codes `[K, N]` and zero points `[G, N]` (uint8, column order)."""
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c of a word is nibble inverse[c]
    q = _nibbles(qweight)[..., inverse].flatten(-2)  # [K, N]
    z = _nibbles(qzeros)[..., inverse].flatten(-2)  # [G, N]
    return q, z


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ words -> codes `[K, N]` (rows packed along K) and stored zeros `[G, N]` (uint8)."""
    q = _nibbles(qweight).permute(0, 2, 1).flatten(0, 1)  # [K / 8, N, 8] -> [K, N]
    z = _nibbles(qzeros).flatten(-2)  # [G, N]
    return q, z


def q4z_rows(q: torch.Tensor, z: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Codes `q` `[N, K]` (uint8 0..15), zero points `z` `[N, K / 32]` (0..16) and fp32 scales `d`
    `[N, K / 32]` -> Q4_Z rows uint8 `[N, K / 32 * 21]`: per block d (4 bytes), z, then 16 bytes
    of nibble pairs in ggml's order (byte j: value j low, value j + 16 high)."""
    n, k = q.shape
    qb = q.reshape(n, k // BLOCK, BLOCK)
    pairs = qb[..., :16] | (qb[..., 16:] << 4)  # [N, B, 16]
    scale = d.to(torch.float32).contiguous().flatten().view(torch.uint8).reshape(n, k // BLOCK, 4)
    return torch.cat((scale, z.to(torch.uint8).unsqueeze(-1), pairs), dim=-1).reshape(n, -1).contiguous()


def dequantize_q4z(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_Z rows uint8 `[..., K / 32 * 21]` -> float32 `[..., K]`: d * (q - z) per block."""
    blocks = rows.reshape(*rows.shape[:-1], k // BLOCK, 21)
    d = blocks[..., :4].contiguous().view(torch.float32)  # [..., B, 1]
    z = blocks[..., 4:5].to(torch.float32)
    pairs = blocks[..., 5:]
    q = torch.cat((pairs & 0xF, pairs >> 4), dim=-1).to(torch.float32)  # [..., B, 32]
    return (d * (q - z)).flatten(-2)


def to_q4z(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, groups: torch.Tensor, zero_offset: int):
    """Codes `q` `[K, N]`, stored zeros `z` `[G, N]`, scales `s` `[G, N]` and the group of each
    input feature `groups` `[K]` -> (Q4_Z rows `[N, K / 32 * 21]`, the feature order they hold:
    None for 0..K-1, else a permutation `[K]` int64). ValueError when a block would straddle
    two groups."""
    perm, block_groups = _block_groups(groups, q.shape[0])
    if perm is not None:
        q = q[perm]
    zb = (z.to(torch.int32) + zero_offset)[block_groups].t()  # [N, B]
    db = s.to(torch.float32)[block_groups].t()  # [N, B]
    return q4z_rows(q.t().contiguous(), zb, db), perm


def unpack_columns(words: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' `pack_to_int32` along dim 1: word `[r, w]` holds values `32 / bits * w + i`
    in its bits `bits * i`.. -> uint8 `[R, W * 32 / bits]` (the stored, offset values)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & mask).to(torch.uint8).flatten(-2)


def q8f_rows(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 values `q` `[N, K]` and fp32 scales `d` `[N, K / 32]` -> Q8_F rows uint8
    `[N, K / 32 * 36]`: per block d (4 bytes), then the 32 int8."""
    n, k = q.shape
    scale = d.to(torch.float32).contiguous().flatten().view(torch.uint8).reshape(n, k // BLOCK, 4)
    values = q.to(torch.int8).view(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return torch.cat((scale, values), dim=-1).reshape(n, -1).contiguous()


def dequantize_q8f(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_F rows uint8 `[..., K / 32 * 36]` -> float32 `[..., K]`: d * q per block."""
    blocks = rows.reshape(*rows.shape[:-1], k // BLOCK, 36)
    d = blocks[..., :4].contiguous().view(torch.float32)  # [..., B, 1]
    q = blocks[..., 4:].contiguous().view(torch.int8).to(torch.float32)  # [..., B, 32]
    return (d * q).flatten(-2)


def _block_groups(groups: torch.Tensor, k: int):
    """The group of each input feature `[K]` -> (the feature order to store: None or a
    permutation, the group of each block of 32 `[K / 32]`). ValueError when a block would
    straddle two groups."""
    groups = groups.to(torch.int64)
    perm = None
    if bool((groups[1:] < groups[:-1]).any()):  # act-order: features sorted by their group
        perm = torch.argsort(groups, stable=True)
        groups = groups[perm]
    block_groups = groups[torch.arange(0, k, BLOCK)]  # [B]
    if not bool((groups.view(-1, BLOCK) == block_groups.unsqueeze(1)).all()):
        raise ValueError("a quantization group does not fill whole blocks of 32 input features")
    return perm, block_groups


def _convert_ct(parts: dict[str, torch.Tensor], name: str):
    """A compressed-tensors pack-quantized layer: `weight_packed` int32 `[N, K * bits / 32]`
    (`pack_to_int32` along K of the values + 2^(bits - 1)), `weight_scale` `[N, G]`, optional
    `weight_zero_point` int32 `[N * bits / 32, G]` (packed along N, offset the same way),
    `weight_g_idx` `[K]`, `weight_shape` `[N, K]`. value = (q - zp) * scale of the feature's group.
    4 bits -> Q4_Z (stored q and zp: their difference is q - zp), 8 bits (symmetric) -> Q8_F."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    packed, s = parts["weight_packed"], parts["weight_scale"]
    if packed.dim() != 2 or packed.shape[0] != n or (32 * packed.shape[1]) % k:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} does not fit weight_shape {[n, k]}")
    bits = 32 * packed.shape[1] // k
    if bits not in (4, 8) or k % BLOCK or s.dim() != 2 or s.shape[0] != n or k % s.shape[1]:
        raise ValueError(f"{name}: {bits}-bit weights of shape {[n, k]} with scales {tuple(s.shape)} "
                         f"are not read (4 or 8 bits, K a multiple of {BLOCK})")
    q = unpack_columns(packed, bits)[:, :k]  # [N, K] stored (offset) values
    g = k // s.shape[1]
    groups = parts["weight_g_idx"] if "weight_g_idx" in parts else torch.arange(k) // g
    perm, block_groups = _block_groups(groups, k)
    if perm is not None:
        q = q[:, perm]
    d = s.to(torch.float32)[:, block_groups]  # [N, B]
    if bits == 8:
        if "weight_zero_point" in parts:
            raise ValueError(f"{name}: 8-bit weights with zero points are not read (symmetric only)")
        rows = q8f_rows((q.to(torch.int16) - 128).to(torch.int8), d)
        return QuantizedTensor(rows, FORMATS["q8_f"], (n, k), -1, perm=perm, dequantizer=dequantize_q8f)
    if "weight_zero_point" in parts:
        zp = unpack_columns(parts["weight_zero_point"].t().contiguous(), bits)[:, :n].t()  # [N, G]
    else:
        zp = torch.full((n, s.shape[1]), 8, dtype=torch.uint8)  # symmetric: q + 8 - 8
    rows = q4z_rows(q, zp[:, block_groups], d)
    return QuantizedTensor(rows, FORMATS["q4_z"], (n, k), -1, perm=perm, dequantizer=dequantize_q4z)


def f8_rows(w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """E4M3 weights `w` `[N, K]` (float8_e4m3fn) and fp32 scales `d` `[N, K / 32]` -> F8_E4M3 rows
    uint8 `[N, K / 32 * 36]`: per block d (4 bytes), then the 32 bytes as stored."""
    n, k = w.shape
    scale = d.to(torch.float32).contiguous().flatten().view(torch.uint8).reshape(n, k // BLOCK, 4)
    values = w.contiguous().view(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return torch.cat((scale, values), dim=-1).reshape(n, -1).contiguous()


def dequantize_f8(rows: torch.Tensor, k: int) -> torch.Tensor:
    """F8_E4M3 rows -> float32 `[..., K]`: d * e4m3 per block."""
    blocks = rows.reshape(*rows.shape[:-1], k // BLOCK, 36)
    d = blocks[..., :4].contiguous().view(torch.float32)  # [..., B, 1]
    w = blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)  # [..., B, 32]
    return (d * w).flatten(-2)


def _convert_fp8(parts: dict[str, torch.Tensor], cfg: HFQuantConfig, name: str):
    """An FP8 layer: `weight` float8_e4m3fn `[N, K]` and `weight_scale_inv` float32
    `[ceil(N / bn), ceil(K / bk)]` (the block [bn, bk] of the config); value = weight * the
    scale of its tile. -> F8_E4M3 rows (each block of 32 inside one tile: bk % 32 == 0)."""
    w, s = parts["weight"], parts["weight_scale_inv"]
    n, k = w.shape
    bn, bk = cfg.block_rows, cfg.group_size
    if k % BLOCK or s.dim() != 2 or tuple(s.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"{name}: weight {tuple(w.shape)} and weight_scale_inv {tuple(s.shape)} do "
                         f"not fit blocks of [{bn}, {bk}] (K a multiple of {BLOCK})")
    d = s.to(torch.float32)[torch.arange(n) // bn][:, torch.arange(0, k, BLOCK) // bk]  # [N, B]
    return QuantizedTensor(f8_rows(w, d), FORMATS["f8_e4m3"], (n, k), -1, dequantizer=dequantize_f8)


def convert(method: str, parts: dict[str, torch.Tensor], cfg: HFQuantConfig, name: str):
    """One layer's checkpoint tensors (`_PARTS[method]`) -> a `QuantizedTensor` `[N, K]`."""
    if method == "compressed-tensors":
        return _convert_ct(parts, name)
    if method == "fp8":
        return _convert_fp8(parts, cfg, name)
    s = parts["scales"]
    if method == "awq":
        q, z = unpack_awq(parts["qweight"], parts["qzeros"])
    else:
        q, z = unpack_gptq(parts["qweight"], parts["qzeros"])
    k, n = q.shape
    if s.shape[-1] != n or z.shape != s.shape:
        raise ValueError(f"{name}: scales {tuple(s.shape)} and zeros {tuple(z.shape)} do not fit "
                         f"codes of {n} output features")
    if k % BLOCK:
        raise ValueError(f"{name}: {k} input features are not whole blocks of {BLOCK}")
    g = k if cfg.group_size == -1 else cfg.group_size
    groups = parts["g_idx"] if "g_idx" in parts else torch.arange(k) // g
    if groups.shape != (k,) or int(groups.min()) < 0 or int(groups.max()) >= s.shape[0]:
        raise ValueError(f"{name}: g_idx must name one of {s.shape[0]} groups for each of {k} features")
    rows, perm = to_q4z(q, z, s, groups, cfg.zero_offset)
    return QuantizedTensor(rows, FORMATS["q4_z"], (n, k), -1, perm=perm, dequantizer=dequantize_q4z)


def hf_quantized_weights(weights: Iterable[tuple[str, Any]], config: Any, method: str, *,
                         keep: bool = True) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each packed layer `<p>.qweight` / `.qzeros` / `.scales`
    (/ `.g_idx`) as one `<p>.weight` `QuantizedTensor` (Q4_Z rows; `keep` False: its float32
    values instead, for `--quantization none` / `int8`); other tensors pass through.
    ValueError (naming `quantization`) for a config this module does not read, or a layer whose
    parts are missing or do not fit."""
    cfg = HFQuantConfig.from_config(config, method)
    names = _PARTS[method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    # NOTE: a layer's optional parts (g_idx, zero points) may come after its needed ones, so a
    # layer is converted only once the checkpoint has moved on to another layer's parts (or
    # ended): tensors are read file by file, a layer's parts side by side in name order.
    for name, source in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in names or (method == "fp8" and leaf == "weight" and not _is_fp8(source)):
            yield name, source
            continue
        for done in [p for p in pending if p != prefix and _complete(pending[p], method)]:
            yield from _emit(method, done, pending.pop(done), cfg, keep)
        pending.setdefault(prefix, {})[leaf] = read_full(source)
    for prefix, parts in pending.items():
        missing = [p for p in _NEEDED[method] if p not in parts]
        if missing:
            raise ValueError(f"quantization={method!r}: {prefix} lacks {missing}")
        yield from _emit(method, prefix, parts, cfg, keep)


def _is_fp8(source: Any) -> bool:
    """Whether a checkpoint tensor (or lazy slice) holds float8_e4m3fn values."""
    dtype = getattr(source, "dtype", None)
    if dtype is None and hasattr(source, "get_dtype"):
        return source.get_dtype() == "F8_E4M3"
    return dtype == torch.float8_e4m3fn


def _complete(parts: dict, method: str) -> bool:
    return all(p in parts for p in _NEEDED[method])


def _emit(method: str, prefix: str, parts: dict, cfg: HFQuantConfig, keep: bool):
    tensor = convert(method, parts, cfg, prefix)
    yield f"{prefix}.weight", tensor if keep else tensor.dequantize()
