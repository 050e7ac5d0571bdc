"""The PEP 517 build backend: setuptools', with torch added for wheel builds only.

- `pip wheel .` / `pip install .`: torch (`[tool.pagedserve] build-torch` in pyproject.toml, or
  `$PAGEDSERVE_BUILD_TORCH`) is installed in the build environment and the CPU kernels are
  compiled into the wheel (`$PAGEDSERVE_BUILD_KERNELS=1`, see setup.py). The wheel's metadata
  then pins `torch==` the version they were compiled against: the C++ ABI of a torch extension
  holds for that torch release only.
- editable installs (`pip install -e .`) and sdists need no torch to build: nothing is compiled,
  the kernels are built on first use (the JIT fallback of `pagedserve.kernels.extension`).
- `PAGEDSERVE_BUILD_KERNELS=0 pip wheel .`: a pure-Python wheel (kernels built on first use).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tomllib
import zipfile
from pathlib import Path

from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F401,F403 -- every other hook unchanged

_ROOT = Path(__file__).resolve().parents[1]
_TORCH_LINE = re.compile(r"^Requires-Dist: torch(?=[\s<>=!~(]|$)(?![^;\n]*;[^\n]*extra)[^\n]*$",
                         re.MULTILINE)


def _kernels() -> bool:
    return os.environ.get("PAGEDSERVE_BUILD_KERNELS", "1").strip() != "0"


def _build_torch() -> str:
    pinned = os.environ.get("PAGEDSERVE_BUILD_TORCH", "").strip()
    if not pinned:
        with open(_ROOT / "pyproject.toml", "rb") as f:
            pinned = tomllib.load(f)["tool"]["pagedserve"]["build-torch"]
    return pinned


def get_requires_for_build_wheel(config_settings=None):
    reqs = list(_meta.get_requires_for_build_wheel(config_settings))
    return reqs + [f"torch=={_build_torch()}"] if _kernels() else reqs


def _pin_line() -> str:
    import torch

    return f"Requires-Dist: torch=={torch.__version__.split('+', 1)[0]}"


def _pin(text: str) -> str:
    new, count = _TORCH_LINE.subn(_pin_line(), text)
    if count != 1:
        raise RuntimeError(f"pagedserve build: expected one torch requirement in METADATA, found {count}")
    return new


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    if _kernels():
        os.environ.setdefault("PAGEDSERVE_BUILD_KERNELS", "1")
    name = _meta.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
    if _kernels():
        path = Path(metadata_directory, name, "METADATA")
        path.write_text(_pin(path.read_text()))
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if not _kernels():
        return _meta.build_wheel(wheel_directory, config_settings, metadata_directory)
    os.environ.setdefault("PAGEDSERVE_BUILD_KERNELS", "1")
    name = _meta.build_wheel(wheel_directory, config_settings, metadata_directory)
    _pin_wheel(Path(wheel_directory, name))
    return name


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _pin_wheel(wheel: Path) -> None:
    """Rewrite the wheel's METADATA with the torch pin (and its line in RECORD)."""
    with zipfile.ZipFile(wheel) as zin:
        items = [(info, zin.read(info)) for info in zin.infolist()]
    meta = next(i.filename for i, _ in items if i.filename.endswith(".dist-info/METADATA"))
    record = meta.rsplit("/", 1)[0] + "/RECORD"
    out = []
    for info, data in items:
        if info.filename == meta:
            data = _pin(data.decode()).encode()
            new_meta = data
        out.append([info, data])
    for entry in out:
        if entry[0].filename == record:
            lines = [f"{meta},{_record_hash(new_meta)},{len(new_meta)}" if line.startswith(meta + ",")
                     else line for line in entry[1].decode().splitlines()]
            entry[1] = ("\n".join(lines) + "\n").encode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for info, data in out:
            zout.writestr(info, data)
    tmp.replace(wheel)
