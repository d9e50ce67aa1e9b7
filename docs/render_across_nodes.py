"""Plot training-step time against link rate from ``hpcddp bench train --json`` files (and
docs/horovod_step.py's), one per rate and job (written by docs/across_nodes.sh, which records
the rate in the file name); print the table of docs/BENCHMARKS.md with ``--table``.

    python docs/render_across_nodes.py docs/across_nodes/*.json --out docs/across_nodes.png --table
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "ddp": "torch DDP (gloo)",
    "ddp-hpcddp": "torch DDP (hpcddp backend)",
    "ddp-powersgd": "torch DDP + PowerSGD hook (hpcddp backend)",
    "horovod": "Horovod 0.28.1",
    "hpcddp": "hpcddp (default)",
    "hpcddp-fp16": "hpcddp, fp16 gradients",
    "hpcddp-int8": "hpcddp, int8 gradients",
    "hpcddp-powersgd": "hpcddp, PowerSGD rank 1",
    "local-sgd": "hpcddp, local SGD (average every 4)",
    "local": "no communication",
}
SCALE = {"kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0}


def gbits(path: Path) -> float:
    """The link rate in Gbit/s from a name such as ``train-2500mbit.json``."""
    match = re.search(r"(\d+)(kbit|mbit|gbit)", path.name)
    if match is None:
        raise SystemExit(f"{path}: no rate such as 1gbit in the file name")
    return int(match.group(1)) * SCALE[match.group(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", required=True)
    parser.add_argument("--table", action="store_true", help="also print a markdown table (ms, ratio to DDP)")
    args = parser.parse_args()
    series: dict[str, list[tuple[float, float]]] = {}
    for path in args.files:
        for result in json.loads(path.read_text())["results"]:
            series.setdefault(result["variant"], []).append((gbits(path), result["step_ms"]))
    if args.table:
        print_table(series)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for variant, label in LABELS.items():
        points = sorted(series.get(variant, []))
        if points:
            style = ":" if variant == "local" else "-"
            axes.plot(*zip(*points), style, marker="o", markersize=4, label=label)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("link rate of each node (Gbit/s, tc tbf)")
    axes.set_ylabel("training step (ms, median)")
    axes.set_title("MLP 8.4M parameters, 2 virtual nodes x 2 ranks")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


def print_table(series: dict[str, list[tuple[float, float]]]) -> None:
    """Print step ms (ratio to torch DDP on gloo at the same rate) per variant and rate."""
    rates = sorted({rate for points in series.values() for rate, _ in points})
    ddp = dict(series.get("ddp", []))
    print("| variant | " + " | ".join(f"{r:g} Gbit/s" for r in rates) + " |")
    print("|---|" + "---|" * len(rates))
    for variant, label in LABELS.items():
        by_rate = dict(series.get(variant, []))
        if not by_rate:
            continue
        cells = []
        for rate in rates:
            ms = by_rate.get(rate)
            ratio = f" ({ms / ddp[rate]:.2f})" if ms is not None and rate in ddp else ""
            cells.append("-" if ms is None else f"{ms:.0f}{ratio}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
