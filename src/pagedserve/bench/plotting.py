"""Figures of the benchmarks (matplotlib, headless): a row of panels, axis labels, saving."""

from __future__ import annotations

from typing import Any


def panel_row(count: int, panel_width: float, height: float) -> tuple[Any, list[Any]]:
    """A figure with `count` panels side by side: `(figure, [axes, ...])`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(panel_width * count, height), squeeze=False)
    return fig, list(axes[0])


def label_panel(ax: Any, *, title: str, ylabel: str, xlabel: str | None = None, legend: bool = False) -> None:
    """Title and axis labels of one panel (and its legend)."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=8)


def save_figure(fig: Any, path: str, *, legend_below: bool = False) -> None:
    """Lay out, write `path` (120 dpi) and free the figure; `legend_below` leaves room for a
    figure-wide legend along the bottom."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0.06, 1, 1) if legend_below else None)
    fig.savefig(path, dpi=120)
    plt.close(fig)
