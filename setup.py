"""Build script for the compiled CPU kernels; everything else is in pyproject.toml.

The wheel carries one library per extension declared by the kernel modules
(`LazyExtension(...)` calls, read by `src/pagedserve/kernels/build.py`), compiled here with the
same `torch.utils.cpp_extension.load` call and flags as the run-time JIT build, for every ISA
level at once (the AVX-512 / AMX code carries target attributes; the library picks at run time),
into `pagedserve/kernels/_prebuilt/` with `build_info.json` (the torch version they were
compiled against, each library's source digest).

`$PAGEDSERVE_BUILD_KERNELS`: 1 = compile (an error if that fails; the wheel build sets it, see
`_build_backend/`), 0 = never (a pure-Python package: the kernels are built on first use),
unset = compile when torch is importable here (an editable install with build isolation has no
torch, so it compiles nothing and the JIT build takes over).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "src" / "pagedserve" / "kernels"
PREBUILT_PACKAGE = "pagedserve.kernels._prebuilt"


def _kernel_build_module():
    """src/pagedserve/kernels/build.py, loaded by path (it imports only the standard library)."""
    spec = importlib.util.spec_from_file_location("_pagedserve_kernel_build", KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


kb = _kernel_build_module()
DECLS = {f"{PREBUILT_PACKAGE}.{d.prefix}": d for d in kb.declared_extensions(KERNELS)}


def _mode() -> str:
    mode = os.environ.get("PAGEDSERVE_BUILD_KERNELS", "").strip().lower()
    if mode in ("", "auto"):
        return "auto"
    if mode in ("1", "0"):
        return mode
    raise SystemExit(f"PAGEDSERVE_BUILD_KERNELS={mode!r}: must be 1, 0 or unset")


def _want_kernels() -> bool:
    mode = _mode()
    if mode != "auto":
        return mode == "1"
    return platform.machine().lower() in ("x86_64", "amd64") \
        and importlib.util.find_spec("torch") is not None


class BuildKernels(build_ext):
    """Each extension through `cpp_extension.load` (the JIT's call, into a build folder of its
    own), the library copied to where setuptools expects it, then build_info.json beside it."""

    def run(self) -> None:
        self._entries: dict[str, dict] = {}
        if self.extensions and importlib.util.find_spec("torch") is None:
            raise SystemExit("pagedserve: compiling the CPU kernels needs torch in the build "
                             "environment (pip wheel . installs it; with --no-build-isolation "
                             "install torch first), or PAGEDSERVE_BUILD_KERNELS=0 for a "
                             "pure-Python wheel")
        try:
            super().run()
        except Exception as e:  # noqa: BLE001
            if _mode() == "1":
                raise
            print(f"pagedserve: compiling the CPU kernels failed ({e}); they will be built on "
                  f"first use instead", file=sys.stderr)
            return
        if not self.extensions:
            return
        import torch

        info = {"torch": torch.__version__, "torch_git": torch.version.git_version,
                "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "compiler": _compiler(),
                "python": platform.python_version(), "machine": platform.machine(),
                "extensions": self._entries}
        folders = {Path(self.get_ext_fullpath(name)).parent for name in DECLS}
        if self.inplace or getattr(self, "editable_mode", False):
            folders.add(KERNELS / "_prebuilt")
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / kb.BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")

    def build_extension(self, ext: Extension) -> None:
        import torch
        from torch.utils import cpp_extension

        decl = DECLS[ext.name]
        digest = kb.decl_digest(decl, kb.CSRC)
        name = kb.jit_build_name(decl.prefix, kb.CSRC, Path(torch.__file__).parent,
                                 torch.__version__, digest)
        # NOTE: where this checkout's JIT build (same sources, same torch) already compiled the
        # library, reuse its folder: ninja finds it up to date (CI builds the wheel after the
        # test run without compiling again). Else a folder under build/.
        folder = Path(cpp_extension._get_build_directory(name, False))
        if not (folder / f"{name}.so").exists():
            folder = Path(self.build_temp).resolve() / "kernels" / name
            folder.mkdir(parents=True, exist_ok=True)
        print(f"pagedserve: compiling {decl.prefix} ({len(decl.sources)} sources) in {folder}",
              file=sys.stderr, flush=True)
        cpp_extension.load(
            name=name, sources=[str(kb.CSRC / s) for s in decl.sources],
            extra_cflags=[*kb.BASE_CFLAGS, *decl.cflags], extra_ldflags=list(kb.BASE_LDFLAGS),
            extra_include_paths=[str(kb.CSRC)], build_directory=str(folder),
            is_python_module=False, verbose=False)
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / f"{name}.so", target)
        self._entries[decl.prefix] = {"file": target.name, "digest": digest}


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return cxx


ext_modules = []
if _want_kernels():
    ext_modules = [Extension(name, sources=[f"src/pagedserve/kernels/csrc/{s}" for s in d.sources])
                   for name, d in DECLS.items()]

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildKernels})
