"""Shared by the reliability scripts: start a server (the tests' tiny random Llama, or the
embedded model) on a free loopback port, and save bar charts."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))

from server_utils import SERVER_FLAGS, ServerProcess


def start_tiny_server(*flags: str) -> ServerProcess:
    """The tests' tiny random Llama behind the real server, with the tests' flags + `flags`."""
    import tiny

    work = Path(tempfile.mkdtemp(prefix="pagedserve-reliability-"))
    model = tiny.make_checkpoint(work / "llama", "llama")
    return ServerProcess.start(str(model), *SERVER_FLAGS, *flags, log_dir=work)


def bar_chart(path: Path, title: str, labels: list[str], values: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar(labels, values, color=["#4c72b0", "#55a868", "#dd8452", "#c44e52",
                                         "#8172b3"][: len(labels)])
    ax.bar_label(bars, labels=[f"{v:g}" for v in values])
    ax.set_title(title)
    ax.margins(y=0.15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
