"""Pareto plots for ``autoremat bench``: step peak against step time, one marker per method.

The vertical axis is the step peak as a percentage of the plain step's peak *in the same
measurement system* (storage accounting for eager rows, the OS high-water mark for the
``torch.compile`` rows), so compiled and eager points can share one axis; the right-hand
axis gives the eager figure in MiB. Lower-left is better. autoremat's plans are joined
into a frontier.

Needs matplotlib (``pip install autoremat[plot]``); uses the Agg backend, no display.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from autoremat._bench.rows import BenchRow, ModelResult
from autoremat._core.errors import RematError

__all__ = ["PLOT_HINT", "can_plot", "pareto_plot"]

PLOT_HINT = "the Pareto plots need matplotlib: pip install 'autoremat[plot]'"

# method -> (marker, colour, filled); one style per method, colour-blind-safe (Okabe-Ito)
_STYLES: dict[str, tuple[str, str, bool]] = {
    "no checkpointing": ("o", "#000000", True),
    "autoremat optimal": ("D", "#0072B2", True),
    "checkpoint per block": ("s", "#E69F00", True),
    "HF gradient_checkpointing": ("P", "#CC79A7", True),
    "checkpoint_sequential": ("^", "#009E73", True),
    "SAC per block": ("v", "#D55E00", True),
    "torch.compile": ("X", "#56B4E9", True),
    "no checkpointing (OS)": ("o", "#777777", False),
    "torch.compile + checkpoint per block": ("s", "#E69F00", False),
    "torch.compile + SAC per block": ("v", "#D55E00", False),
    "autoremat + torch.compile": ("D", "#0072B2", False),
}
_PLANS = ("autoremat optimal", "autoremat + torch.compile")  # joined into frontiers
_COMPILED = ("torch.compile", "torch.compile + checkpoint per block",
             "torch.compile + SAC per block", "autoremat + torch.compile")


def _point(row: BenchRow, axis: str) -> tuple[float, float] | None:
    x = row.time_ratio if axis == "time" else row.recompute_pct
    if row.status != "ok" or x is None or row.peak_fraction is None:
        return None
    return x, 100 * row.peak_fraction


def can_plot() -> bool:
    """Whether matplotlib is installed (the plots are optional; the tables are not)."""
    return importlib.util.find_spec("matplotlib") is not None


def pareto_plot(result: ModelResult, path: str | Path) -> Path:
    """Write the Pareto plot of one model's bench rows to ``path`` (PNG) and return it.

    Two panels share the vertical axis (step peak): against measured step time (what
    users feel, noisy on a shared machine) and against recompute FLOPs (exact).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from rich.console import Console
        >>> from autoremat._bench.bench import Settings, run_bench
        >>> settings = Settings(budgets=("75%",), repeats=1, compile=False,
        ...                     overrides=(("widths", (128,) * 4), ("batch_size", 256)))
        >>> (result,) = run_bench(["mlp"], settings, console=Console(quiet=True))
        >>> with tempfile.TemporaryDirectory() as out:
        ...     pareto_plot(result, Path(out) / "mlp.png").stat().st_size > 0
        True
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RematError(PLOT_HINT) from exc

    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 5.4), dpi=110, sharey=True,
                                      gridspec_kw={"width_ratios": [1.25, 1]})
    try:
        _draw(left, result, "time")
        _draw(right, result, "flops")
        left.set_ylabel("step peak, % of no checkpointing")
        left.legend(fontsize=7.5, loc="upper right", framealpha=0.9)
        plain_mib = result.plain_peak_bytes / 2**20

        def to_mib(percent: Any) -> Any:
            return percent * plain_mib / 100

        def to_percent(mib: Any) -> Any:
            return mib * 100 / plain_mib

        mib_axis = right.secondary_yaxis("right", functions=(to_mib, to_percent))
        mib_axis.set_ylabel("eager step peak (MiB)")
        fig.suptitle(f"{result.target} ({result.model}): step peak against step time and "
                     f"recompute; lower left is better", fontsize=11)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def _draw(ax: Any, result: ModelResult, axis: str) -> None:
    seen: set[str] = set()
    xs: list[float] = []
    ys: list[float] = []
    frontiers: dict[str, dict[tuple[float, float], str]] = {m: {} for m in _PLANS}
    for row in result.rows:
        xy = _point(row, axis)
        if xy is None:
            continue
        marker, colour, filled = _STYLES.get(row.method, ("o", "#999999", True))
        label = row.method + (" (OS-measured)" if row.method in _COMPILED
                              and row.peak_source == "os" else "")
        wrong = row.grads_equal is False and not row.grads_rounding_only
        xerr = None
        if axis == "time" and row.time_ratio_range is not None:
            lo, hi = row.time_ratio_range
            xerr = [[max(0.0, xy[0] - lo)], [max(0.0, hi - xy[0])]]
        xs.append(xy[0])
        ys.append(xy[1])
        ax.errorbar(
            *xy, xerr=xerr, fmt=marker, ms=8 if filled else 9, color=colour,
            mfc=colour if filled else "none", mec="#C00000" if wrong else colour,
            mew=2 if wrong else 1.2, ecolor=colour, elinewidth=0.8, alpha=0.9, capsize=2,
            label=None if label in seen else label, zorder=3)
        seen.add(label)
        if row.method in frontiers:
            frontiers[row.method].setdefault(xy, row.budget)
        elif row.method == "torch.compile":
            ax.annotate(f"budget {row.budget.split()[0]}" + (", grads differ" if wrong else ""),
                        xy, fontsize=7, xytext=(6, -10), textcoords="offset points",
                        color="#1f5f80")
    for method, frontier in frontiers.items():
        if not frontier:
            continue
        points = sorted(frontier, key=lambda p: (p[1], p[0]))
        ax.plot([p[0] for p in points], [p[1] for p in points],
                "-" if method == _PLANS[0] else "--", color="#0072B2", lw=1.2, alpha=0.6,
                zorder=2)
        for xy in points:
            ax.annotate(_short(frontier[xy]), xy, fontsize=7, xytext=(6, 4),
                        textcoords="offset points", color="#0072B2")
    origin = 1.0 if axis == "time" else 0.0
    if xs:  # frame the points; long spread bars may run off the edge
        pad = max(0.05 if axis == "time" else 2.0, 0.12 * (max(xs) - min(xs)))
        ax.set_xlim(min(min(xs), origin) - pad, max(max(xs), origin) + pad)
        pad_y = max(2.0, 0.08 * (max(ys) - min(ys)))
        ax.set_ylim(max(0.0, min(ys) - pad_y), max(max(ys), 100.0) + pad_y)
    ax.axhline(100, color="#bbbbbb", lw=0.8, zorder=1)
    ax.axvline(origin, color="#bbbbbb", lw=0.8, zorder=1)
    if axis == "time":
        ax.set_xlabel("step time / no-checkpointing step time (median; bar: min to max)")
        ax.set_title("measured time (noisy on a shared CPU)", fontsize=9)
    else:
        ax.set_xlabel("recompute FLOPs, % of the plain step (matmul/attention/conv)")
        ax.set_title("recompute FLOPs (exact; pointwise ops not counted)", fontsize=9)
    ax.grid(alpha=0.25)


def _short(budget: str) -> str:
    return budget.replace("peak of ", "= ").replace("torch.compile + ", "compile+") \
        .replace("below the references", "below").replace("checkpoint per block", "per-block") \
        .replace("HF gradient_checkpointing", "HF").replace("checkpoint_sequential", "seq") \
        .replace("SAC per block", "SAC")
