"""Line plots as PNG files: the one place that draws (train's loss curve, the benchmark's
memory/time panels, the planner's memory vs length, bench_train's curves).

A plot is a list of `Panel`s side by side, each a list of `Series`; `save_plot` writes it.
matplotlib is an optional dependency (`pip install 'upipe[train]'`): without it
`save_plot` warns once per call and writes nothing, so a missing plot never stops a run.
matplotlib is imported inside `save_plot` (no import-time cost or backend choice here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings


@dataclasses.dataclass(kw_only=True)
class Series:
    label: str | None
    """Legend entry (None: not in the legend)."""
    xs: list
    ys: list
    style: dict = dataclasses.field(default_factory=dict)
    """matplotlib `plot` keywords, plus an optional format string under "fmt" (".-")."""


@dataclasses.dataclass(kw_only=True)
class Panel:
    series: list[Series]
    xlabel: str
    ylabel: str
    title: str | None = None
    xlog: bool = False
    """log2 x axis (sequence lengths)."""
    ylog: bool = False
    ylim: tuple[float, float] | None = None
    hlines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    """Horizontal dashed lines (y, legend label), e.g. a memory budget."""
    integer_x: bool = False
    """Integer ticks on x (steps)."""


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def save_plot(
    path: str, panels: list[Panel], *, title: str | None = None, size=None, legend_below=False
) -> bool:
    """Draw `panels` side by side into the PNG `path`; returns whether it was written.
    `legend_below`: one legend for the whole figure under the panels (series of the same
    labels in every panel), else a legend per panel that has labelled series."""
    if not have_matplotlib():
        warnings.warn(
            f"no plot written to {path}: matplotlib is not installed (pip install 'upipe[train]')",
            stacklevel=2,
        )
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    size = size or (5.5 * len(panels) if len(panels) > 1 else 6.5, 4.2)
    fig, axes = plt.subplots(1, len(panels), figsize=size, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for s in panel.series:
            style = dict(s.style)
            fmt = style.pop("fmt", None)
            ax.plot(s.xs, s.ys, *([fmt] if fmt else []), label=s.label, **style)
        for y, label in panel.hlines:
            ax.axhline(y, color="k", ls="--", label=label)
        if panel.xlog:
            ax.set_xscale("log", base=2)
        if panel.ylog:
            ax.set_yscale("log")
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        if panel.integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        if panel.title:
            ax.set_title(panel.title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        labelled = any(s.label for s in panel.series) or panel.hlines
        if labelled and not legend_below:
            ax.legend(fontsize=7)
    bottom = 0.0
    if legend_below:
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False, fontsize=8)
        rows = -(-len(labels) // 4)
        bottom = (rows + 1) * 0.22 / fig.get_figheight()  # about 0.22 inch per legend row
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
