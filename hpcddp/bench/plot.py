"""PNG of allreduce bus bandwidth against message size (matplotlib, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence

from .allreduce import AllreduceResult
from .metrics import format_size

__all__ = ["plot_busbw"]


def plot_busbw(results: Sequence[AllreduceResult], path: str, title: str = "") -> None:
    """Write a log-log plot of busbw (GB/s) against size, one line per path, to ``path``.

    With one rank busbw is 0 by definition, so algbw is plotted instead.

    Args:
        results: rows from ``sweep_allreduce``.
        path: the PNG file to write.
        title: the figure title.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install 'hpcddp[plot]' (or pip install matplotlib)") from err
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
