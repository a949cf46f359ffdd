"""The results' plots: matplotlib figures written as SVG text.

matplotlib is the ``bench`` extra (``pip install -e ".[bench]"``), imported when a plot is drawn.
The SVG keeps its text as text (searchable, small), fixed ids and no date, so a plot drawn
again from the same results is the same file. Elements a reader (or a test) counts carry ids:
each bar ``<gid>-<i>``, each group of points ``<gid>``.
"""

from __future__ import annotations

import io
from typing import Sequence

COLORS = ["#2b6cb0", "#e39b2d", "#38a169", "#c53030", "#805ad5", "#d69e2e", "#319795", "#718096"]
FASTER, SLOWER, MISSING = "#2e7d32", "#c62828", "#9e9e9e"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def figure(title: str, *, width: float, height: float, rows: int = 1, sharex: bool = False):
    """A figure of ``rows`` axes stacked (inches), titled; returns (figure, list of axes)."""
    plt = _pyplot()
    fig, axes = plt.subplots(rows, 1, figsize=(width, height), sharex=sharex, squeeze=False, layout="constrained")
    fig.suptitle(title, fontsize=11, fontweight="bold")
    return fig, [ax for (ax,) in axes]


def to_svg(fig) -> str:
    """The figure as SVG text (text as text, ids from a fixed salt, no date); closes it."""
    plt = _pyplot()
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "torch-sparserl"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buffer.getvalue()


def unity(ax) -> None:
    """The line at 1× (no change) across the axes."""
    ax.axhline(1.0, color="black", linewidth=1.2, zorder=1)


def no_results(ax) -> None:
    """What an empty document draws."""
    ax.text(0.5, 0.5, "no results yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def strip(ax, columns: Sequence[tuple[str, Sequence[float], str]], *, gid: str = "points",
          offset: float = 0.0) -> None:
    """One column of points per ``(label, values, colour)``, at x = 0, 1, ... (+ ``offset``);
    the points of column i carry the id ``<gid>-<i>``."""
    for i, (_, values, colour) in enumerate(columns):
        dots = ax.scatter([i + offset] * len(values), list(values), s=14, color=colour, alpha=0.7, zorder=3)
        dots.set_gid(f"{gid}-{i}")
    ax.set_xticks(range(len(columns)), [label for label, _, _ in columns], rotation=45, ha="right")
    ax.set_xlim(-0.6, len(columns) - 0.4)


def grouped_bars(ax, labels: Sequence[str], series: dict[str, tuple[Sequence[float | None], str]], *,
                 gid: str = "bar") -> None:
    """For each label a group of bars, one per series ``name: (values, colour)`` (None: no bar);
    the bars carry the ids ``<gid>-<i>``, in drawing order."""
    width = 0.8 / max(1, len(series))
    count = 0
    for j, (name, (values, colour)) in enumerate(series.items()):
        named = False  # the legend names each series once
        for i, value in enumerate(values):
            if value is None:
                continue
            (bar,) = ax.bar(i - 0.4 + (j + 0.5) * width, value, width * 0.9, color=colour,
                            label=None if named else name, zorder=2)
            bar.set_gid(f"{gid}-{count}")
            named, count = True, count + 1
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(labels) - 0.4)


def times_axis(ax, ticks: Sequence[float] | None = None, *, log: bool = False) -> None:
    """The y axis of ratios: ticks written ``2×`` (at ``ticks`` where given), on a log scale
    with ``log``."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if log:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    if ticks is not None:
        ax.set_yticks(list(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}×"))
    ax.grid(axis="y", color="#e0e0e0")
    ax.set_axisbelow(True)
