"""The figures of `pagedserve bench memory`: the KV memory breakdown by allocator (the paper's
Fig. 2) and the sharing savings of parallel sampling and beam search (Fig. 15)."""

from __future__ import annotations

from pagedserve.bench.memory_paper import (
    CATEGORIES,
    LABELS,
    PAPER_BEAM_SAVINGS,
    PAPER_PARALLEL_SAVINGS,
)
from pagedserve.bench.plotting import label_panel, panel_row, save_figure


def plot_breakdown(shares: dict[str, dict[str, dict[str, float]]], path: str) -> None:
    """Stacked bars of each allocator's shares, one panel per trace."""
    fig, axes = panel_row(len(shares), 5.5, 4.2)
    colors = ("#4c72b0", "#dd8452", "#c44e52", "#8c8c8c")
    for ax, (trace, per_alloc) in zip(axes, shares.items()):
        names = list(per_alloc)
        bottom = [0.0] * len(names)
        for cat, color in zip(CATEGORIES, colors):
            vals = [100 * per_alloc[a][cat] for a in names]
            ax.bar([LABELS[a] for a in names], vals, bottom=bottom, color=color, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, a in enumerate(names):
            share = 100 * per_alloc[a]["token states"]
            ax.text(x, share / 2, f"{share:.1f}%", ha="center", va="center", color="white",
                    fontsize=9)
        ax.set_ylim(0, 100)
        label_panel(ax, title=f"KV memory usage ({trace})", ylabel="KV cache memory (%)")
        ax.tick_params(axis="x", labelsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(CATEGORIES), fontsize=8)
    save_figure(fig, path, legend_below=True)


def plot_sharing(savings: dict[str, dict[int, float]], path: str) -> None:
    """Bars of parallel-sampling savings by n, one panel per trace, paper's values as markers."""
    fig, axes = panel_row(len(savings), 5, 3.8)
    for ax, (panel, by_n) in zip(axes, savings.items()):
        beam = panel.endswith(" beam")
        trace = panel.removesuffix(" beam")
        figures = PAPER_BEAM_SAVINGS if beam else PAPER_PARALLEL_SAVINGS
        ns = list(by_n)
        xs = range(len(ns))
        ax.bar(xs, [100 * by_n[n] for n in ns], color="#4c72b0", label="pagedserve")
        ax.set_xticks(xs, [str(n) for n in ns])
        paper = [(x, float(figures[(trace, n)].rstrip("%")))
                 for x, n in zip(xs, ns) if (trace, n) in figures]
        if paper:
            ax.plot([p[0] for p in paper], [p[1] for p in paper], "k^", label="paper")
        kind = "beam search" if beam else "parallel sampling"
        label_panel(ax, title=f"{kind} ({trace})", ylabel="memory saving (%)", legend=True,
                    xlabel="beam width" if beam else "# output sequences (parallel sampling)")
    save_figure(fig, path)
