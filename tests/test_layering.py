"""Who may import whom under src/pagedserve: benchmarks stay out of the runtime, models import no
engine, the configuration and the core import no torch (read from the sources' import
statements, lazy ones inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedserve"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(*parts: str) -> list[Path]:
    return sorted(SRC.joinpath(*parts).rglob("*.py")) if parts else sorted(SRC.rglob("*.py"))


def _offenders(paths, forbidden: str) -> list[str]:
    return [f"{p.relative_to(SRC)}: {name}" for p in paths for name in sorted(_imports(p))
            if name == forbidden or name.startswith(forbidden + ".")]


def test_the_runtime_imports_nothing_from_the_benchmarks():
    # Only the CLI (which offers `bench`) and the benchmarks themselves reach into bench/.
    runtime = [p for p in _modules() if p.relative_to(SRC).parts[0] != "bench"
               and p != SRC / "entrypoints" / "cli.py"]
    assert _offenders(runtime, "pagedserve.bench") == []


def test_models_import_no_engine():
    assert _offenders(_modules("models"), "pagedserve.engine") == []


@pytest.mark.parametrize("part", ["core", "config.py"])
def test_configuration_and_core_import_no_torch(part):
    paths = _modules("core") if part == "core" else [SRC / part]
    assert _offenders(paths, "torch") == []
