"""`pagedserve collect-env`: what a bug report needs (as `vllm collect-env`): versions, the CPU
and its ISA flags, which code path the compiled kernels take and whether they came prebuilt with
the wheel or were built here (JIT), the torch build, threads and the environment variables that
change behaviour. Loads the kernels (a first JIT build logs its progress)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

# CPU flags (as /proc/cpuinfo spells them) that decide the kernels' ISA level (kernels.cpu_isa).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
             "avx512_bf16", "amx_tile", "amx_bf16")
PACKAGES = ("transformers", "tokenizers", "safetensors", "gguf", "numpy", "xgrammar", "fastapi",
            "uvicorn", "pydantic", "triton", "ray")
ENV_PREFIXES = ("PAGEDSERVE_", "OMP_", "MKL_", "KMP_", "TORCH_EXTENSIONS_DIR", "CUDA_VISIBLE",
                "CXX", "CC")


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and flags, from /proc/cpuinfo ("unknown" elsewhere)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if not line.strip():
            break  # the first processor is enough
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    if "model name" in fields:
        model = (f"{fields['model name']} ({fields.get('vendor_id', '?')}, family "
                 f"{fields.get('cpu family', '?')}, model {fields.get('model', '?')}, stepping "
                 f"{fields.get('stepping', '?')})")
    return model, flags


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"none ({cxx} not found: no JIT build possible)"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout.splitlines() or [cxx])[0].strip()
    except (OSError, subprocess.SubprocessError):
        return cxx


def _install() -> str:
    """Where pagedserve is imported from, and how it was installed (wheel or editable)."""
    import pagedserve

    where = Path(pagedserve.__file__).parent
    try:
        dist = importlib.metadata.distribution("pagedserve")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        kind = "editable install" if direct.get("dir_info", {}).get("editable") else "installed"
    except importlib.metadata.PackageNotFoundError:
        kind = "not installed (on sys.path)"
    return f"{where} ({kind})"


def collect() -> list[tuple[str, list[tuple[str, str]]]]:
    """The report: sections of (key, value) lines."""
    import torch

    from pagedserve import __version__
    from pagedserve.kernels.build import PREBUILT_DIR, read_build_info
    from pagedserve.kernels.cpu_gemm import linear_isa
    from pagedserve.kernels.cpu_isa import ISA_ENV, ISA_NAMES
    from pagedserve.kernels.extension import all_extensions
    from pagedserve.platforms import accelerator_name

    model, flags = _cpuinfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    versions = [("pagedserve", f"{__version__} from {_install()}"),
                ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
                ("os", f"{platform.platform()}, {' '.join(platform.libc_ver())}"),
                ("torch", f"{torch.__version__} (git {torch.version.git_version[:12]}, CUDA "
                          f"{torch.version.cuda}, CXX11 ABI {torch._C._GLIBCXX_USE_CXX11_ABI}, "
                          f"debug {torch.version.debug})")]
    versions += [(name, _version(name)) for name in PACKAGES]
    cpu = [("model", model), ("machine", platform.machine()),
           ("cores", f"{os.cpu_count()} ({usable} usable by this process)"),
           ("ISA flags", " ".join(f if f in flags else f"-{f}" for f in ISA_FLAGS)),
           ("cuda", accelerator_name())]
    info = read_build_info(PREBUILT_DIR)
    if info is None:
        prebuilt = "none (a source checkout or a pure wheel: built on first use, JIT)"
    else:
        prebuilt = (f"{', '.join(info['extensions'])} compiled against torch {info['torch']} "
                    f"with {info.get('compiler', '?')} ({PREBUILT_DIR})")
    kernels = [("prebuilt", prebuilt), ("compiler", _compiler())]
    for ext in all_extensions():
        st = ext.status()
        if st["origin"]:
            value = f"{st['origin']}, {st['isa']} ({st['library']})"
        else:
            value = f"unavailable: {st['failure']}"
        if ext.torch_mismatch:
            value += f" [{ext.torch_mismatch}]"
        kernels.append((ext.prefix, value))
    cap = os.environ.get(ISA_ENV, "")
    kernels.append(("ISA path chosen", f"{ISA_NAMES[linear_isa()]}"
                                       + (f" (capped by ${ISA_ENV}={cap})" if cap else "")))
    from pagedserve.models.loader import resolve_dtype

    kernels.append(("dtype auto on CPU", str(resolve_dtype("auto", None, "cpu")).removeprefix("torch.")))
    threads = [("torch threads", f"{torch.get_num_threads()} intra-op, "
                                 f"{torch.get_num_interop_threads()} inter-op")]
    threads += [("", line.strip()) for line in torch.__config__.parallel_info().splitlines()
                if line.strip() and not line.startswith("ATen/Parallel")]
    env = [(k, v) for k, v in sorted(os.environ.items())
           if k.startswith(ENV_PREFIXES) and "KEY" not in k and "TOKEN" not in k]
    build = [("", line) for line in torch.__config__.show().strip().splitlines()]
    return [("versions", versions), ("CPU", cpu), ("kernels", kernels), ("threads", threads),
            ("environment", env or [("", "(none of PAGEDSERVE_*, OMP_*, MKL_*, ... set)")]),
            ("torch build", build)]


def format_report(sections) -> str:
    lines = []
    for title, rows in sections:
        lines.append(f"== {title} ==")
        width = max((len(k) for k, _ in rows), default=0)
        lines += [f"{k:<{width}} : {v}" if k else f"  {v}" for k, v in rows]
        lines.append("")
    return "\n".join(lines)


def main(args=None) -> int:
    """Print the report (the `collect-env` command)."""
    print(format_report(collect()))
    return 0
