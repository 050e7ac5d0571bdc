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


# --- the platform seam (issue 28): device-specific choices live in platforms/ -----------------

# Kernel modules the model path may import outside platforms/, and why: none of them chooses a
# compute kernel for a layer.
_HOST_SIDE_KERNELS = {
    "layers/quantization.py": {"pagedserve.kernels.cpu_qlinear"},  # the weight formats, packing
    "worker/sampler.py": {"pagedserve.kernels"},  # cpu_sampling / cpu_grammar: the host sampler
    "worker/worker.py": {"pagedserve.kernels.openmp"},  # pinning the stepping thread's team
}


def test_models_import_no_kernel_module():
    # Models stay plain torch: they reach kernels only through the ops their platform bound.
    assert _offenders(_modules("models"), "pagedserve.kernels") == []


def test_attention_backends_import_no_config():
    # The engine's options read the backends' names from attention.backends, not the reverse.
    assert _offenders(_modules("attention"), "pagedserve.config") == []


def test_the_attention_backend_registry_imports_no_torch():
    # config.py imports it (BACKEND_CHOICES) and must stay torch-free.
    assert _offenders([SRC / "attention" / "backends" / "__init__.py"], "torch") == []


def test_only_platforms_choose_kernels():
    """Outside platforms/ (and kernels/ itself) the model path -- layers, models, attention,
    worker -- imports no kernel module, host-side uses named above aside."""
    offenders = []
    for part in ("models", "layers", "attention", "worker"):
        for path in _modules(part):
            allowed = _HOST_SIDE_KERNELS.get(str(path.relative_to(SRC)), set())
            offenders += [o for o in _offenders([path], "pagedserve.kernels")
                          if o.split(": ")[1] not in allowed]
    assert offenders == []


def test_no_device_type_checks_in_models_layers_or_attention_layers():
    """The device checks that chose kernels are gone from models/ and layers/: the platform
    decides (quantization's weight placement check aside)."""
    found = []
    for path in _modules("models") + _modules("layers"):
        text = path.read_text()
        for needle in (".device.type", "torch.cuda", ".is_cuda", "meta.backend =="):
            if needle in text and path.name != "quantization.py":
                found.append(f"{path.relative_to(SRC)}: {needle}")
    assert found == []
