"""PNGs of the benchmarks: allreduce bus bandwidth against size, time-to-accuracy curves (matplotlib, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence

from .allreduce import AllreduceResult
from .metrics import format_size

__all__ = ["plot_busbw", "plot_time_to_accuracy"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install 'hpcddp[plot]' (or pip install matplotlib)") from err
    return plt


def plot_busbw(results: Sequence[AllreduceResult], path: str, title: str = "") -> None:
    """Write a log-log plot of busbw (GB/s) against size, one line per path, to ``path``.

    With one rank busbw is 0 by definition, so algbw is plotted instead.

    Args:
        results: rows from ``sweep_allreduce``.
        path: the PNG file to write.
        title: the figure title.
    """
    plt = _pyplot()
    # busbw is 0 in a world of one (nothing crosses a link): show algbw there.
    metric = "busbw" if any(r.busbw > 0 for r in results) else "algbw"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r.path for r in results):
        rows = [r for r in results if r.path == label]
        axes.plot([r.size for r in rows], [getattr(r, metric) for r in rows], marker="o", markersize=3, label=label)
    sizes = sorted({r.size for r in results})
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    ticks = sizes[:: max(1, len(sizes) // 9)]
    axes.set_xticks(ticks, [format_size(s) for s in ticks], rotation=45)
    axes.set_xlabel("message size")
    axes.set_ylabel(f"{metric} (GB/s)")
    axes.set_title(title or f"allreduce {metric}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_time_to_accuracy(runs: Sequence, path: str, target: float, title: str = "") -> None:
    """Write test accuracy against seconds, one line per run, a colour per variant, to ``path``.

    Args:
        runs: ``StragglerRun`` rows from ``bench_straggler`` (their ``curve``).
        path: the PNG file to write.
        target: the accuracy drawn as a dashed line.
        title: the figure title.
    """
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for run in runs:
        first = run.variant not in colours
        colour = colours.setdefault(run.variant, f"C{len(colours)}")
        seconds, accuracy = zip(*run.curve) if run.curve else ((), ())
        axes.plot(seconds, [100 * a for a in accuracy], color=colour, alpha=0.6, label=run.variant if first else None)
    axes.axhline(100 * target, color="gray", linestyle="--", linewidth=1, label=f"target {100 * target:g} %")
    axes.set_ylim(50, 100)
    axes.set_xlabel("seconds")
    axes.set_ylabel("test accuracy of rank 0's model (%)")
    axes.set_title(title or "time to accuracy")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
