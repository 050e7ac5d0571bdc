"""The batch-size curve of `scripts/bench_vs_peers.py --curve` (issue 40): output tokens/s against
the number of concurrent streams, one column (and one plotted line) per engine, from the rows that
script writes to `results.json` -- so the table and the figure can be rendered again from a saved
run without starting any engine (`--from-results`).

A row (one engine, one concurrency, one round) carries at least `engine` (its display name),
`kind` ("ours", "vllm" or "llama-server"), `concurrency`, `round` and `output_throughput`; and,
when present, `exact_lengths` (every request succeeded with exactly its tokens), `path` (what was
asked of the engine), `isa_path` (the ISA level our kernels ran at) and `cpu` (the CPU model).

Figures per (engine, C) are medians over rounds; a ratio is the median of the rounds' ratios
(ours / that peer in the same round), as in bench_vs_peers' own table. A cell with no run is "-".
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

CURVE_CONCURRENCY = (1, 4, 16, 32, 64, 128)
# Issue 40's growth target compares these two concurrencies.
GROWTH_FROM, GROWTH_TO = 16, 64
MISSING = "-"


def _ours(rows: Sequence[dict]) -> set[str]:
    """The engine names of our configs."""
    return {r["engine"] for r in rows if r["kind"] == "ours"}


def _engines(rows: Sequence[dict]) -> list[str]:
    """Engine names, ours first, each group in order of first appearance."""
    names, ours = list(dict.fromkeys(r["engine"] for r in rows)), _ours(rows)
    return [n for n in names if n in ours] + [n for n in names if n not in ours]


def _runs(rows: Sequence[dict], engine: str, c: int) -> list[dict]:
    """`engine`'s rows at concurrency `c`, one per round it ran."""
    return [r for r in rows if r["engine"] == engine and r["concurrency"] == c]


def median_throughput(rows: Sequence[dict], engine: str, c: int) -> float | None:
    """The median output tokens/s of `engine` at concurrency `c` over its rounds; None if it has
    no run there."""
    runs = _runs(rows, engine, c)
    return statistics.median(r["output_throughput"] for r in runs) if runs else None


def round_ratio(rows: Sequence[dict], ours: str, peer: str, c: int) -> float | None:
    """The median over rounds of ours' tokens/s / `peer`'s in the same round at concurrency `c`;
    None when no round has both."""
    mine = {r["round"]: r["output_throughput"] for r in _runs(rows, ours, c)}
    ratios = [mine[r["round"]] / r["output_throughput"] for r in _runs(rows, peer, c)
              if r["round"] in mine and r["output_throughput"] > 0]
    return statistics.median(ratios) if ratios else None


def growth(rows: Sequence[dict], engine: str, low: int = GROWTH_FROM,
           high: int = GROWTH_TO) -> float | None:
    """`engine`'s median tokens/s at `high` streams over its median at `low`; None if either is
    missing."""
    a, b = median_throughput(rows, engine, low), median_throughput(rows, engine, high)
    if a is None or b is None or a <= 0:
        return None
    return b / a


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def _short(engine: str, ours_count: int) -> str:
    return "ours" if ours_count == 1 else engine


def curve_table(rows: Sequence[dict], concurrency: Iterable[int] | None = None) -> str:
    """The markdown table: a row per concurrency, a column per engine (median output tokens/s;
    "*" when some run there did not produce exactly the requested tokens), then ours / each peer
    (median of the rounds' ratios). `concurrency` defaults to every C the rows have."""
    engines = _engines(rows)
    ours = [n for n in engines if n in _ours(rows)]
    peers = [n for n in engines if n not in ours]
    cs = sorted(set(concurrency) if concurrency is not None else {r["concurrency"] for r in rows})
    ratio_cols = [(o, p) for o in ours for p in peers]
    header = (["C"] + engines
              + [f"{_short(o, len(ours))} / {p}" for o, p in ratio_cols])
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" for _ in header) + " |"]
    for c in cs:
        cells = [str(c)]
        for n in engines:
            cell = _fmt(median_throughput(rows, n, c), ".1f")
            if any(r.get("exact_lengths") is False for r in _runs(rows, n, c)):
                cell += "*"
            cells.append(cell)
        cells += [_fmt(round_ratio(rows, o, p, c), ".2f", "x") for o, p in ratio_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth_line(rows: Sequence[dict]) -> str:
    """Each engine's growth from GROWTH_FROM to GROWTH_TO streams (issue 40's target for ours:
    >= 1.3x)."""
    parts = [f"{n} {_fmt(growth(rows, n), '.2f', 'x')}" for n in _engines(rows)]
    return (f"Growth C={GROWTH_TO} / C={GROWTH_FROM} (median tok/s): " + ", ".join(parts)
            + " (issue 40's target for ours: >= 1.3x)")


def _cpu_text(rows: Sequence[dict], cpu: str | None) -> str:
    """The CPU model(s) the rows name, else `cpu`, else "not recorded"."""
    cpus = list(dict.fromkeys(r["cpu"] for r in rows if r.get("cpu")))
    return ", ".join(cpus) if cpus else (cpu or "not recorded")


def _isa_paths(rows: Sequence[dict]) -> dict[str, str]:
    """Each of our configs' ISA path ("not recorded" when no row has one)."""
    ours = _ours(rows)
    return {n: next((r["isa_path"] for r in rows if r["engine"] == n and r.get("isa_path")),
                    "not recorded")
            for n in _engines(rows) if n in ours}


def describe(rows: Sequence[dict], cpu: str | None = None) -> str:
    """The lines above the table: the CPU model, then each engine with what it ran (`path`) and,
    for our configs, the ISA path."""
    cpu_text = _cpu_text(rows, cpu)
    # NOTE: a curve run in parts may have a different number of rounds per C.
    rounds = {}
    for r in rows:
        rounds[r["concurrency"]] = max(rounds.get(r["concurrency"], 0), r["round"])
    per_c = ", ".join(f"C={c} {n}" for c, n in sorted(rounds.items()))
    lines = [f"CPU: {cpu_text}; output tokens/s, medians over rounds "
             f"(most rounds at each C: {per_c})"]
    isas = _isa_paths(rows)
    for n in _engines(rows):
        path = next(r.get("path") for r in rows if r["engine"] == n)
        what = [f"ISA path {isas[n]}"] if n in isas else []
        what += [path] if path else []
        lines.append(f"{n}: {'; '.join(what) or 'not recorded'}")
    return "\n".join(lines)


def report(rows: Sequence[dict], concurrency: Iterable[int] | None = None,
           cpu: str | None = None) -> str:
    """The whole text: description, table, footnote and growth line."""
    text = [describe(rows, cpu), "", curve_table(rows, concurrency), ""]
    if any(r.get("exact_lengths") is False for r in rows):
        text.append("* some requests there failed or did not produce exactly the requested tokens")
    text.append(growth_line(rows))
    return "\n".join(text)


def plot_curve(rows: Sequence[dict], path: str, cpu: str | None = None) -> None:
    """Write a PNG of median output tokens/s against streams (log2 x axis), one line per engine,
    titled with the CPU model and our ISA path(s); concurrencies an engine has no run at are left
    out of its line."""
    from pagedserve.bench.plotting import label_panel, panel_row, save_figure

    fig, (ax,) = panel_row(1, 6.5, 4.2)
    cs = sorted({r["concurrency"] for r in rows})
    for n in _engines(rows):
        points = [(c, median_throughput(rows, n, c)) for c in cs]
        points = [(c, y) for c, y in points if y is not None]
        if points:
            ax.plot([c for c, _ in points], [y for _, y in points], marker="o",
                    linewidth=2.2 if n in _ours(rows) else 1.4, label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    isas = ", ".join(dict.fromkeys(_isa_paths(rows).values())) or MISSING
    label_panel(ax, title=f"{_cpu_text(rows, cpu)}\nour ISA path: {isas}",
                ylabel="output tokens/s", xlabel="concurrent streams", legend=True)
    save_figure(fig, path)
