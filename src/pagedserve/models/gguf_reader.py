"""A GGUF header reader and tensor access of our own (pure struct + numpy memory map).

`gguf.GGUFReader` builds a numpy view per vocabulary entry and takes ~9 s on a 262k-token
vocabulary; walking the header with `struct` takes a fraction of a second. Dequantization is
`gguf`'s. Nothing here unpickles anything: tensors are raw bytes read through a read-only map.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType) with a fixed width: struct format per type id.
_SCALAR_FORMATS = {
    0: "<B",  # UINT8
    1: "<b",  # INT8
    2: "<H",  # UINT16
    3: "<h",  # INT16
    4: "<I",  # UINT32
    5: "<i",  # INT32
    6: "<f",  # FLOAT32
    7: "<?",  # BOOL
    10: "<Q",  # UINT64
    11: "<q",  # INT64
    12: "<d",  # FLOAT64
}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9


# ---------------------------------------------------------------------------------------------
# Header reading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in a GGUF file and how it is stored."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order (GGUF stores dims fastest-first, i.e. reversed)
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor table, without any tensor data.

    `metadata` maps keys to Python values. String arrays not asked for in `read_gguf_header`'s
    `string_arrays` (the vocabulary, the merges) are left as their length, an `int`, since decoding
    a 262k-entry vocabulary is wasted work when only its size is needed.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        """The `general.architecture` string, e.g. "gemma3"."""
        return str(self.metadata["general.architecture"])

    def tensor(self, name: str) -> GGUFTensorInfo | None:
        """The tensor called `name`, or None."""
        for info in self.tensors:
            if info.name == name:
                return info
        return None

    def arch_key(self, key: str, default: Any = None) -> Any:
        """Metadata `<architecture>.<key>`, e.g. `arch_key("block_count")`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require_arch_key(self, key: str) -> Any:
        """`arch_key(key)`, or ValueError naming the file and the missing key."""
        value = self.arch_key(key)
        if value is None:
            raise ValueError(f"{self.path.name}: metadata key {self.architecture}.{key} is missing")
        return value


def read_gguf_header(path: str | os.PathLike[str], string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (little-endian GGUF v2/v3).

    Args:
        path: the GGUF file.
        string_arrays: metadata keys whose string arrays to decode in full; others are kept as
            their length.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, or a version/feature this reader does not handle.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _parse_header(blob, path, string_arrays)
    except struct.error as exc:  # ran past the end of the file
        raise ValueError(f"{path} is truncated or corrupt: {exc}") from exc


def _parse_header(blob: np.memmap, path: Path, string_arrays: tuple[str, ...]) -> GGUFHeader:
    if len(blob) < 24 or bytes(blob[:4]) != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _GGUF_VERSIONS:
        if version & 0xFFFF == 0:
            raise ValueError(f"{path} is a big-endian GGUF file, which is not supported")
        raise ValueError(f"{path} is GGUF version {version}; supported versions: {_GGUF_VERSIONS}")

    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _read_value(blob, pos + 4, value_type, key in string_arrays, path)
    if "general.architecture" not in metadata:
        raise ValueError(f"{path} has no general.architecture metadata key")

    entries = []
    for _ in range(tensor_count):
        name, pos = _read_string(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        ggml_type, rel_offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        # NOTE: GGUF lists dims fastest-moving first ([cols, rows]); torch order is the reverse.
        entries.append((name, tuple(int(d) for d in reversed(dims)), int(ggml_type), int(rel_offset)))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment={alignment} is not a power of two")
    data_start = (pos + alignment - 1) // alignment * alignment

    tensors = []
    for name, shape, ggml_type, rel_offset in entries:
        nbytes = _tensor_nbytes(name, shape, ggml_type, path)
        start = data_start + rel_offset
        if start + nbytes > len(blob):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        tensors.append(GGUFTensorInfo(name, shape, ggml_type, start, nbytes))
    return GGUFHeader(path=path, metadata=metadata, tensors=tuple(tensors))


def _read_string(blob: np.memmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    pos += 8
    return bytes(blob[pos : pos + length]).decode("utf-8", errors="replace"), pos + length


def _read_value(blob: np.memmap, pos: int, value_type: int, keep_strings: bool, path: Path) -> tuple[Any, int]:
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        (value,) = struct.unpack_from(fmt, blob, pos)
        if value_type == _FLOAT32:
            # NOTE: the shortest decimal that rounds to the same float32, so 1e-5 reads back as 1e-5
            # (HF's value) rather than 9.99999974e-06.
            value = float(str(np.float32(value)))
        return value, pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[element_type]
            width = struct.calcsize(fmt)
            values = np.frombuffer(blob, dtype=np.dtype(fmt), count=count, offset=pos).tolist()
            return values, pos + count * width
        if element_type == _STRING:
            if keep_strings:
                strings = []
                for _ in range(count):
                    value, pos = _read_string(blob, pos)
                    strings.append(value)
                return strings, pos
            for _ in range(count):  # variable length: walk it without decoding
                (length,) = struct.unpack_from("<Q", blob, pos)
                pos += 8 + length
            return count, pos
        raise ValueError(f"{path}: metadata array of element type {element_type} is not supported")
    raise ValueError(f"{path}: metadata value type {value_type} is not supported")


def _tensor_nbytes(name: str, shape: tuple[int, ...], ggml_type: int, path: Path) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
    if shape and shape[-1] % block_size:
        raise ValueError(f"{path}: tensor {name} row of {shape[-1]} is not a multiple of {qtype.name} blocks")
    return math.prod(shape) // block_size * type_size


def _read_tensor_f32(blob: np.memmap, info: GGUFTensorInfo) -> torch.Tensor:
    """Dequantize one tensor to a fresh float32 torch tensor of `info.shape`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = info.shape or (1,)
    row_bytes = shape[-1] // block_size * type_size
    raw = blob[info.offset : info.offset + info.nbytes].reshape(*shape[:-1], row_bytes)  # uint8 [..., row_bytes]
    try:
        values = dequantize(raw, qtype)  # float32 [..., cols]
    except NotImplementedError:
        raise ValueError(f"{info.name}: ggml type {qtype.name} cannot be dequantized by gguf") from None
    # NOTE: F32 comes back as a view of the read-only memory map: copy it, so the torch tensor owns
    # writable memory and does not pin the file. Other types are dequantized into fresh arrays.
    copy = qtype == GGMLQuantizationType.F32 or not values.flags.writeable
    values = np.array(values, dtype=np.float32, copy=copy).reshape(info.shape)
    return torch.from_numpy(values)


def _read_quantized(blob: np.memmap, info: GGUFTensorInfo):
    """The tensor's blocks as a `QuantizedTensor` (a copy: the model does not pin the file), or
    None if it is not a 2-D tensor (or 3-D: an MoE layer's stacked experts) in a format the
    kernel reads."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from pagedserve.layers.quantization import FORMATS, GGML_FORMATS, QuantizedTensor

    qtype = GGMLQuantizationType(info.ggml_type)
    name = GGML_FORMATS.get(qtype.name)
    if name is None or len(info.shape) not in (2, 3):
        return None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    *rows, cols = info.shape
    raw = blob[info.offset : info.offset + info.nbytes].reshape(*rows, cols // block_size * type_size)
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # [(E,) rows, row_bytes]
    return QuantizedTensor(data, FORMATS[name], tuple(info.shape), int(info.ggml_type))


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

# GGUF architecture -> HF model_type / architectures entry.
