"""The in-tree build backend (_build_backend/pagedserve_build.py): torch only for wheel builds,
and the built wheel's metadata pinning the torch its kernels were compiled against."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def backend():
    spec = importlib.util.spec_from_file_location(
        "pagedserve_build", ROOT / "_build_backend" / "pagedserve_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METADATA = ("Metadata-Version: 2.4\nName: pagedserve\nRequires-Dist: torch<2.14,>=2.11\n"
            "Requires-Dist: torchvision; extra == \"x\"\nRequires-Dist: ray>=2.9; extra == \"ray\"\n"
            "Requires-Dist: torch>=2; extra == \"other\"\n")
PIN = f"Requires-Dist: torch=={torch.__version__.split('+')[0]}"


def test_wheel_builds_need_the_pinned_torch_editable_builds_do_not(backend, monkeypatch):
    # setuptools' own answer (it runs setup.py) stubbed: the backend only adds torch to it
    monkeypatch.setattr(backend._meta, "get_requires_for_build_wheel", lambda cs=None: ["wheel"])
    monkeypatch.delenv("PAGEDSERVE_BUILD_KERNELS", raising=False)
    monkeypatch.delenv("PAGEDSERVE_BUILD_TORCH", raising=False)
    assert backend.get_requires_for_build_wheel() == ["wheel", "torch==2.13.0"]
    # editable installs (and sdists) keep setuptools' hooks: no torch to build, nothing compiled
    assert backend.get_requires_for_build_editable is backend._meta.get_requires_for_build_editable
    assert backend.build_editable is backend._meta.build_editable
    monkeypatch.setenv("PAGEDSERVE_BUILD_TORCH", "2.12.1")
    assert backend.get_requires_for_build_wheel() == ["wheel", "torch==2.12.1"]
    monkeypatch.setenv("PAGEDSERVE_BUILD_KERNELS", "0")
    assert backend.get_requires_for_build_wheel() == ["wheel"]


def test_the_pin_replaces_only_the_main_torch_requirement(backend):
    lines = backend._pin(METADATA).splitlines()
    assert lines[2] == PIN
    assert lines[3:] == METADATA.splitlines()[3:]  # torchvision, extras untouched


def test_the_pinned_wheel_keeps_a_valid_record(backend, tmp_path):
    wheel = tmp_path / "pagedserve-0.1.0-cp311-cp311-linux_x86_64.whl"
    meta, record = "pagedserve-0.1.0.dist-info/METADATA", "pagedserve-0.1.0.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pagedserve/__init__.py", "x = 1\n")
        z.writestr(meta, METADATA)
        z.writestr(record, f"pagedserve/__init__.py,sha256=abc,6\n{meta},sha256=old,1\n{record},,\n")
    backend._pin_wheel(wheel)
    with zipfile.ZipFile(wheel) as z:
        data = z.read(meta)
        rows = {line.split(",")[0]: line for line in z.read(record).decode().splitlines()}
        assert z.read("pagedserve/__init__.py") == b"x = 1\n"
    assert PIN in data.decode().splitlines()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert rows[meta] == f"{meta},sha256={digest},{len(data)}"
    assert rows["pagedserve/__init__.py"] == "pagedserve/__init__.py,sha256=abc,6"
