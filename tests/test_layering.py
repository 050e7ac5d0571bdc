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


def test_the_common_attention_metadata_imports_no_backend():
    # Each backend builds its own metadata subclass (attention/backends/): the common part names
    # none of them (and importing it would be a cycle: the backends import it).
    assert _offenders([SRC / "attention" / "metadata.py"], "pagedserve.attention.backends") == []


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
    decides."""
    found = []
    for path in _modules("models") + _modules("layers"):
        text = path.read_text()
        for needle in (".device.type", "torch.cuda", ".is_cuda", "meta.backend =="):
            if needle in text:
                found.append(f"{path.relative_to(SRC)}: {needle}")
    assert found == []


# The one module outside platforms/ that may touch torch.cuda: it captures and replays CUDA graphs
# (the platform decides whether it runs: `Platform.use_cuda_graphs`).
_CUDA_MODULES = {"worker/cuda_graphs.py"}


def _cuda_checks(path: Path, name: str) -> list[str]:
    """`torch.cuda` uses and comparisons with the literal "cuda" in `path` (shown as `name`),
    in line order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            found.append((node.lineno, f"{name}:{node.lineno}: torch.cuda"))
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "cuda"
                for c in [node.left, *node.comparators]):
            found.append((node.lineno, f"{name}:{node.lineno}: == 'cuda'"))
    return [text for _, text in sorted(found)]


def test_device_checks_live_in_platforms():
    """Outside platforms/ nothing asks torch.cuda or compares a device with "cuda": the
    engine, workers, executors, distributed setup and benchmarks ask their platform
    (`default_device`, `synchronize`, `dist_backend`, `worker_bundle`, `threads_per_worker`,
    `is_host`)."""
    found = []
    for path in _modules():
        rel = str(path.relative_to(SRC))
        if rel.split("/")[0] != "platforms" and rel not in _CUDA_MODULES:
            found += _cuda_checks(path, rel)
    assert found == []


def test_the_device_check_finder_finds_both_kinds(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nx = torch.cuda.is_available()\ny = dev.type == 'cuda'\n"
                      "z = dev.type == 'cpu'\n")
    assert _cuda_checks(sample, "sample.py") == ["sample.py:2: torch.cuda", "sample.py:3: == 'cuda'"]


# --- the module graph (issue 39): no import cycles, no upward imports --------------------------


def test_the_engine_imports_no_entrypoints():
    # Chat rendering lives in engine/chat_template.py, below both the server and `LLM.chat`.
    assert _offenders(_modules("engine"), "pagedserve.entrypoints") == []


def test_platforms_import_no_worker():
    # A platform describes its device; the worker runs on it (and measures through it).
    assert _offenders(_modules("platforms"), "pagedserve.worker") == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> the pagedserve modules it imports, every import statement counted: top level,
    lazy ones inside functions and `TYPE_CHECKING` ones alike. `from a import b` is an edge to
    the module `a.b` when there is one, else to `a` (a package's `__init__`)."""
    names = {}
    for path in _modules():
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{path.relative_to(SRC)}: a relative import"
                targets.update(known(f"{node.module}.{a.name}") if f"{node.module}.{a.name}"
                               in names else known(node.module) for a in node.names)
        graph[module] = targets - {None, module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative):
    each is one import cycle, however many loops run through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(import_cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_cycles_in_src():
    """No module of src/pagedserve reaches itself through its imports (lazy and TYPE_CHECKING
    imports included): a shared piece moves below both users, or a caller passes it down."""
    assert import_cycles(_module_graph()) == []


def test_the_step_update_reaches_the_scheduler_only_through_its_interface():
    """core/step_update.py uses of `scheduler.<name>` are members of its `StepTarget` (no
    reaching into the scheduler's queues, block manager or config); spec_decode and the
    proposers never see the scheduler."""
    tree = ast.parse((SRC / "core" / "step_update.py").read_text())
    target = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepTarget")
    members = {n.name for n in target.body if isinstance(n, ast.FunctionDef)}
    members |= {n.target.id for n in target.body if isinstance(n, ast.AnnAssign)}
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "scheduler"}
    assert used and used <= members, sorted(used - members)
    speculation = [SRC / "core" / "spec_decode.py"] + _modules("core", "proposers")
    assert _offenders(speculation, "pagedserve.core.scheduler") == []
    assert [p.name for p in speculation if any(
        isinstance(n, ast.arg) and n.arg == "scheduler"
        for n in ast.walk(ast.parse(p.read_text())))] == []
