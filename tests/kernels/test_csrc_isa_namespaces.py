"""csrc's one naming scheme for ISA code (cpu_isa.h's NOTE on ISA namespaces), read from the
sources: every `#pragma GCC target` region opens the file's anonymous namespace and, in it, a
namespace `isa_<level>` named by the ISA level its target features need. No compiler needed."""

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "src" / "pagedserve" / "kernels" / "csrc"
SOURCES = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
LEVELS = ("isa_avx2", "isa_avx512", "isa_avx512bf16", "isa_amx")


def level_of(features: str) -> str:
    """The cpu_isa.h level whose kernels a target pragma's feature list builds."""
    names = {f.strip() for f in features.split(",")}
    if names & {"amx-tile", "amx-bf16", "amx-int8"}:
        return "isa_amx"
    if "avx512bf16" in names:
        return "isa_avx512bf16"
    if any(n.startswith("avx512") for n in names):
        return "isa_avx512"
    return "isa_avx2"


def target_regions(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, features, the next two code lines) of each `#pragma GCC target` in `text`."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = re.match(r'\s*#pragma GCC target\("([^"]+)"\)', line)
        if not m:
            continue
        after = [ln.strip() for ln in lines[i + 1:] if ln.strip() and not ln.strip().startswith("//")]
        found.append((i + 1, m.group(1), after[:2]))
    return found


def test_the_scanner_finds_regions_and_names_levels():
    text = '#pragma GCC target("avx2,fma")\n\n// x\nnamespace {\nnamespace isa_avx2 {\n'
    assert target_regions(text) == [(1, "avx2,fma", ["namespace {", "namespace isa_avx2 {"])]
    assert level_of("avx2,fma,f16c,avx512f,avx512bw") == "isa_avx512"
    assert level_of("avx2,avx512f,avx512bf16,avx512vnni") == "isa_avx512bf16"
    assert level_of("avx512bf16,amx-tile,amx-bf16") == "isa_amx"


def test_csrc_has_target_regions_to_check():
    assert sum(len(target_regions(p.read_text())) for p in SOURCES) >= 10


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_isa_region_is_an_internal_isa_namespace_named_by_its_level(path):
    for line, features, after in target_regions(path.read_text()):
        where = f"{path.name}:{line} ({features})"
        assert after[:1] == ["namespace {"], f"{where}: not inside an anonymous namespace: {after}"
        assert after[1:] == [f"namespace {level_of(features)} {{"], f"{where}: named {after[1:]}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_isa_namespace_outside_the_scheme(path):
    text = path.read_text()
    for m in re.finditer(r"^\s*namespace (\w*(?:avx|amx|isa|vec_)\w*) \{", text, re.M):
        if m.group(1) == "ps_isa":  # cpu_isa.h's detection, not ISA code
            continue
        assert m.group(1) in LEVELS, f"{path.name}: namespace {m.group(1)} is not one of {LEVELS}"
    # per-function target attributes: only always-inline helpers shared by several ISA builds
    for m in re.finditer(r"__attribute__\(\(target\([^)]*\)([^)]*)\)\)", text):
        assert "always_inline" in m.group(1), f"{path.name}: {m.group(0)} (use an isa_* region)"
