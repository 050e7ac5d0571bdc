"""What the wheel build reads (pagedserve.kernels.build): the kernel modules' LazyExtension
declarations, read from their source text, are the extensions the run time uses, and every header
their sources include is declared (in the digest) and shipped (package data)."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pagedserve.kernels import build
from pagedserve.kernels.extension import all_extensions

ROOT = Path(__file__).resolve().parents[2]


def test_declarations_read_from_source_are_the_runtime_extensions():
    declared = {d.prefix: d for d in build.declared_extensions()}
    runtime = {e.prefix: e for e in all_extensions()}
    assert set(declared) == set(runtime) and len(declared) >= 3
    for prefix, ext in runtime.items():
        d = declared[prefix]
        assert [p.name for p in ext.sources] == list(d.sources)
        assert [p.name for p in ext.headers] == list(d.headers)
        assert list(ext.cflags) == list(d.cflags)
        assert build.decl_digest(d) == ext.digest()  # what a wheel records = what the run time checks


def _local_includes(path: Path) -> set[str]:
    return set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.MULTILINE))


def test_every_header_a_source_includes_is_declared_and_shipped():
    """The bug of issue 26: the wheel shipped the .cpp files but not the .h files they include."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["pagedserve"]
    for d in build.declared_extensions():
        seen, todo = set(), [build.CSRC / s for s in d.sources]
        while todo:
            for name in _local_includes(todo.pop()) - seen:
                seen.add(name)
                todo.append(build.CSRC / name)
        assert seen <= set(d.headers), f"{d.prefix}: undeclared headers {seen - set(d.headers)}"
    for path in build.CSRC.iterdir():
        rel = f"kernels/csrc/{path.name}"
        assert any(fnmatch(rel, g) for g in globs), f"{rel} is not package data"


def test_declarations_may_name_module_level_lists(tmp_path):
    (tmp_path / "mod.py").write_text(
        'SRC = ["a.cpp", "b.cpp"]\nCOMMON = ("c.h",)\nFLAGS = ["-x"]\n'
        'E = LazyExtension("pfx", SRC + ["d.cpp"], [*COMMON, "a.h"], cflags=FLAGS, probe=None,\n'
        '                  describe=None)\n')
    (d,) = build.declared_extensions(tmp_path)
    assert (d.module, d.prefix, d.sources, d.headers, d.cflags) == (
        "pagedserve.kernels.mod", "pfx", ("a.cpp", "b.cpp", "d.cpp"), ("c.h", "a.h"), ("-x",))


def test_a_declaration_setup_py_cannot_read_is_an_error_naming_it(tmp_path):
    (tmp_path / "mod.py").write_text(
        'E = LazyExtension("pfx", sorted(FILES), [], cflags=[], probe=None, describe=None)\n')
    with pytest.raises(ValueError, match=r"mod.py:1: .*literals.*sorted\(FILES\)"):
        build.declared_extensions(tmp_path)


def test_two_extensions_with_one_name_are_an_error(tmp_path):
    line = 'LazyExtension("pfx", ["a.cpp"], [], cflags=[], probe=None, describe=None)\n'
    (tmp_path / "a.py").write_text(line)
    (tmp_path / "b.py").write_text(line)
    with pytest.raises(ValueError, match="second LazyExtension named 'pfx'"):
        build.declared_extensions(tmp_path)


def test_the_digest_changes_with_a_source_a_header_or_a_flag(tmp_path):
    src, hdr = tmp_path / "k.cpp", tmp_path / "k.h"
    src.write_text("int a;")
    hdr.write_text("#pragma once")
    first = build.content_digest([src], [hdr], ["-O3"])
    assert first == build.content_digest([src], [hdr], ["-O3"])
    hdr.write_text("#pragma once\n")
    second = build.content_digest([src], [hdr], ["-O3"])
    assert second != first and build.content_digest([src], [hdr], []) != second


def test_the_python_formats_are_the_csrc_table_and_the_kernel_agrees():
    """kernels.cpu_qlinear.FORMATS is generated from csrc/qformats.h (no second list): the same
    rows, and the compiled dispatch (generated from the same table) sizes every row as Python
    does; an unknown code is refused by both."""
    import torch

    from pagedserve.kernels.cpu_qlinear import FORMATS, GGML_FORMATS, quantized_available

    rows = build.quant_formats()
    assert [(r.name, r.code, r.block, r.block_bytes) for r in rows] == \
        [(f.name, f.code, f.block, f.block_bytes) for f in FORMATS.values()]
    assert GGML_FORMATS["Q4_K"] == "q4_k" and "q4_z" in FORMATS and not FORMATS["q4_z"].ggml
    if not quantized_available():
        pytest.skip("compiled CPU kernels unavailable")
    for f in FORMATS.values():
        for k in (256, 512):
            assert torch.ops.pagedserve_cpu.qrow_bytes(f.code, k) == f.row_bytes(k), f.name
    assert torch.ops.pagedserve_cpu.qrow_bytes(max(f.code for f in FORMATS.values()) + 1, 256) == -1


def test_a_malformed_table_row_is_refused_naming_its_line(tmp_path):
    text = (build.CSRC / build.QFORMATS_HEADER).read_text()
    broken = text.replace("X(Q8_0,  1,", "X(Q8_0,  one,", 1)
    assert broken != text
    (tmp_path / build.QFORMATS_HEADER).write_text(broken)
    with pytest.raises(ValueError, match=r"qformats.h:\d+: not a table row"):
        build.quant_formats(tmp_path)
    (tmp_path / build.QFORMATS_HEADER).write_text(text.replace("X(Q5_K,  3,", "X(Q5_K,  2,", 1))
    with pytest.raises(ValueError, match="a code appears twice"):
        build.quant_formats(tmp_path)
