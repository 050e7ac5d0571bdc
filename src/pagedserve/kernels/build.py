"""What the CPU extensions are made of, read without importing torch or pagedserve: the wheel
build (`setup.py`) and the run time share it.

- `declared_extensions()`: every `LazyExtension(prefix, sources, headers, cflags=...)` call in
  the kernel modules (`kernels/*.py`), read from their source text (ast). NOTE: the kernel
  modules' calls are the one list of files and flags; `setup.py` builds the wheel's libraries
  from what this returns, so a new source, header or extension declared there is in the next
  wheel. The arguments must be literals (or names bound to literals at module level).
- `content_digest()`: a hash of an extension's files and flags; a prebuilt library is used only
  when the digest recorded at wheel build equals the one of the sources installed beside it.
- `quant_formats()`: the rows of csrc/qformats.h, the one table of weight formats (the C++
  dispatch is generated from it by macros; `kernels.cpu_qlinear.FORMATS` from this).
- `PREBUILT_DIR`, `BUILD_INFO`: where the wheel puts the compiled libraries and what it records
  about their build (the torch version they were compiled against, the compiler, each library's
  file and digest).

This module imports only the standard library (setup.py loads it by path).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
CSRC = KERNELS_DIR / "csrc"
PREBUILT_DIR = KERNELS_DIR / "_prebuilt"
BUILD_INFO = "build_info.json"

# Flags every extension is compiled with (JIT and wheel alike), before its own `cflags`.
# NOTE: -fopenmp is required: at::parallel_for is a header template over `#pragma omp parallel`;
# libgomp then resolves to the copy torch has already loaded (same soname). No -march: the
# AVX-512 / AMX code carries target attributes, so one library holds every ISA level's code and
# picks at run time (one x86-64 wheel for every x86-64 CPU).
BASE_CFLAGS = ("-O3", "-fopenmp")
BASE_LDFLAGS = ("-fopenmp",)


class KernelsUnavailableError(RuntimeError):
    """The compiled CPU kernels are required (`require_kernels`) but cannot load."""


@dataclass(frozen=True)
class ExtensionDecl:
    """One `LazyExtension(...)` call: the module declaring it (`pagedserve.kernels.<name>`), the
    library's prefix (its name), its sources and headers (file names under csrc/), its cflags."""

    module: str
    prefix: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...]


def _module_literals(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level `NAME = <expr>` assignments (so a declaration may name a list)."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            out[node.target.id] = node.value
    return out


def _literal(node: ast.expr, names: dict[str, ast.expr], where: str, depth: int = 0):
    """The value of a literal, a module-level name bound to one, a list / tuple of such (with
    `*name` items) or a `+` of lists; ValueError (naming `where`) for anything else."""
    if depth < 8:
        if isinstance(node, ast.Name) and node.id in names:
            return _literal(names[node.id], names, where, depth + 1)
        if isinstance(node, (ast.List, ast.Tuple)):
            out: list = []
            for item in node.elts:
                if isinstance(item, ast.Starred):
                    out += list(_literal(item.value, names, where, depth + 1))
                else:
                    out.append(_literal(item, names, where, depth + 1))
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return list(_literal(node.left, names, where, depth + 1)) + \
                list(_literal(node.right, names, where, depth + 1))
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{where}: LazyExtension arguments must be literals (or module-level names "
                         f"bound to literals, lists of them, list + list) so that setup.py can "
                         f"read them: {ast.unparse(node)!r}") from None


def declared_extensions(kernels_dir: Path = KERNELS_DIR) -> list[ExtensionDecl]:
    """Every LazyExtension declared in `kernels_dir/*.py`, sorted by prefix. ValueError for a
    declaration whose arguments are not literals, or two with one prefix."""
    found: dict[str, ExtensionDecl] = {}
    for path in sorted(kernels_dir.glob("*.py")):
        if path.name == "extension.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = _module_literals(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyExtension"):
                continue
            where = f"{path.name}:{node.lineno}"
            args = dict(zip(("prefix", "sources", "headers"), node.args))
            args.update({k.arg: k.value for k in node.keywords if k.arg})
            decl = ExtensionDecl(
                module=f"pagedserve.kernels.{path.stem}",
                prefix=_literal(args["prefix"], names, where),
                sources=tuple(_literal(args["sources"], names, where)),
                headers=tuple(_literal(args["headers"], names, where)) if "headers" in args else (),
                cflags=tuple(_literal(args["cflags"], names, where)) if "cflags" in args else ())
            if decl.prefix in found:
                raise ValueError(f"{where}: a second LazyExtension named {decl.prefix!r}")
            found[decl.prefix] = decl
    return [found[k] for k in sorted(found)]


def content_digest(sources, headers, cflags) -> str:
    """A hash of the files (names and bytes; Paths) and flags an extension is compiled from."""
    digest = hashlib.sha1()
    for flag in (*BASE_CFLAGS, *cflags):
        digest.update(flag.encode() + b"\0")
    for path in [*sources, *headers]:
        path = Path(path)
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def decl_digest(decl: ExtensionDecl, csrc: Path = CSRC) -> str:
    """`content_digest` of a declaration's files under `csrc`."""
    return content_digest([csrc / s for s in decl.sources], [csrc / h for h in decl.headers],
                          decl.cflags)


def jit_build_name(prefix: str, csrc: Path, torch_dir: Path, torch_version: str,
                   digest: str) -> str:
    """The JIT build folder's (and library's) name: the prefix and a hash of the sources' folder,
    the torch installation and the content digest (see `LazyExtension.build_name`)."""
    h = hashlib.sha1(str(Path(csrc).resolve()).encode())
    h.update(f"{torch_dir}:{torch_version}".encode())
    h.update(digest.encode())
    return f"{prefix}_{h.hexdigest()[:12]}"


def read_build_info(prebuilt_dir: Path = PREBUILT_DIR) -> dict | None:
    """The wheel's record of its compiled libraries (None in a source checkout)."""
    path = prebuilt_dir / BUILD_INFO
    if not path.is_file():
        return None
    return json.loads(path.read_text())


QFORMATS_HEADER = "qformats.h"


@dataclass(frozen=True)
class FormatRow:
    """One row of csrc/qformats.h's `PS_QFORMATS` table (see the header for the columns)."""

    name: str  # lower-cased: the Python name ("q4_k")
    code: int
    block: int
    block_bytes: int
    head: int
    kernel: str  # "DENSE" | "DOT8"
    gemm: str  # "NONE" | "Q8" | "VNNI"
    ggml: str  # the GGUF type name, "" for none


_ROW = re.compile(r'^\s*X\(\s*(\w+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,'
                  r'\s*(DENSE|DOT8)\s*,\s*(NONE|Q8|VNNI)\s*,\s*"(\w*)"\s*\)\s*\\?\s*$')


def quant_formats(csrc: Path = CSRC) -> list[FormatRow]:
    """The rows of the `PS_QFORMATS` X-macro of csrc/qformats.h, in table order. ValueError naming
    the line for a row that does not parse, or a repeated name or code. NOTE: the table is the
    one source of truth: the C++ dispatch is generated from the same rows by the preprocessor."""
    lines = (csrc / QFORMATS_HEADER).read_text().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("#define PS_QFORMATS(X)"))
    except StopIteration:
        raise ValueError(f"{QFORMATS_HEADER}: no `#define PS_QFORMATS(X)` table") from None
    rows: list[FormatRow] = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not line.strip():
            break
        m = _ROW.match(line)
        if m is None:
            raise ValueError(f"{QFORMATS_HEADER}:{i + 1}: not a table row: {line.strip()!r}")
        name, code, block, nbytes, head, kernel, gemm, ggml = m.groups()
        rows.append(FormatRow(name.lower(), int(code), int(block), int(nbytes), int(head), kernel, gemm, ggml))
        if not line.rstrip().endswith("\\"):
            break
    for attr in ("name", "code"):
        values = [getattr(r, attr) for r in rows]
        if len(set(values)) != len(values):
            raise ValueError(f"{QFORMATS_HEADER}: a {attr} appears twice in the table: {values}")
    return rows
