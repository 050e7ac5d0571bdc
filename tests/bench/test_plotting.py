"""The benchmarks' figures are written as PNG files, one panel per trace, with their labels."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from pagedserve.bench import plotting  # noqa: E402
from pagedserve.bench.memory_plots import plot_breakdown, plot_sharing  # noqa: E402
from pagedserve.bench.paper import PointResult, plot_batch, plot_latency  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _point(allocator, rate, latency, batch):
    return PointResult("sharegpt", allocator, rate, 10, 10, 5.0, latency, 2.0, 40.0, batch, 8,
                       500.0, 600.0, False)


def _written(path) -> bool:
    return path.read_bytes().startswith(PNG)


def test_every_benchmark_figure_is_written_as_png(tmp_path):
    shares = {"sharegpt": {a: {"token states": 0.5, "reservation": 0.2, "internal frag": 0.2,
                               "external frag": 0.1} for a in ("paged", "max")}}
    plot_breakdown(shares, str(tmp_path / "breakdown.png"))
    plot_sharing({"sharegpt": {2: 0.16, 4: 0.25}, "sharegpt beam": {2: 0.4}},
                 str(tmp_path / "sharing.png"))
    points = {"sharegpt": [_point(a, r, 0.1 * r * (2 if a != "paged" else 1), 3.0 * r)
                           for a in ("paged", "contiguous-max") for r in (1.0, 2.0)]}
    plot_latency(points, str(tmp_path / "latency.png"), slo=0.3)
    plot_batch(points, str(tmp_path / "batch.png"))
    for name in ("breakdown", "sharing", "latency", "batch"):
        assert _written(tmp_path / f"{name}.png"), name


def test_panels_carry_their_labels_and_the_figure_is_closed(tmp_path):
    import matplotlib.pyplot as plt

    fig, axes = plotting.panel_row(2, 3.0, 2.0)
    assert len(axes) == 2 and tuple(fig.get_size_inches()) == (6.0, 2.0)
    axes[0].plot([0, 1], [0, 1], label="line")
    plotting.label_panel(axes[0], title="T", ylabel="Y", xlabel="X", legend=True)
    plotting.label_panel(axes[1], title="U", ylabel="Z")
    assert (axes[0].get_title(), axes[0].get_xlabel(), axes[0].get_ylabel()) == ("T", "X", "Y")
    assert axes[0].get_legend() is not None and axes[1].get_legend() is None
    assert axes[1].get_xlabel() == ""
    plotting.save_figure(fig, str(tmp_path / "f.png"), legend_below=True)
    assert _written(tmp_path / "f.png") and not plt.fignum_exists(fig.number)
