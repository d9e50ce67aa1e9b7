"""Draw one training step of an hpcddp timeline (Chrome-trace JSON) as a PNG, for the README.

    HPCDDP_TIMELINE=timeline.json mpirun -np 2 hpcddp bench train --model mlp --variants hpcddp --repeats 1
    python docs/render_timeline.py timeline.json docs/timeline.png --step 10

Perfetto (https://ui.perfetto.dev) shows the same file interactively; this script only
makes a still picture of it where no browser is at hand.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "step": "#55a868",
    "synchronize": "#8c8c8c",
    "optimizer.step": "#64b5cd",
    "copy-in": "#c44e52",
    "queue": "#dddddd",
    "allreduce": "#8172b3",
    "copy-out": "#937860",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("png")
    parser.add_argument("--step", type=int, default=5, help="which step (0-based, per rank) to draw")
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    spans = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            spans[(event["pid"], event["tid"])].append(event)
    forwards = sorted((e for e in spans[(0, 0)] if e["name"] == "forward"), key=lambda e: e["ts"])
    steps = sorted((e for e in spans[(0, 0)] if e["name"] == "step"), key=lambda e: e["ts"])
    start = forwards[args.step]["ts"]
    end = steps[args.step]["ts"] + steps[args.step]["dur"]
    margin = (end - start) * 0.03
    rows = sorted(spans, key=lambda key: (key[0], key[1]))
    figure, axes = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.2))
    for y, key in enumerate(reversed(rows)):
        # Parents first, so that their phases are drawn on top of them.
        for event in sorted(spans[key], key=lambda e: -e["dur"]):
            if event["ts"] + event["dur"] < start - margin or event["ts"] > end + margin:
                continue
            parent = event["name"].startswith("bucket ") or event["name"] == "step"
            nested = event["name"] == "optimizer.step"
            left, width = (event["ts"] - start) / 1000, event["dur"] / 1000
            height = 0.8 if parent else 0.4 if nested else 0.6
            colour = "#f3f3f3" if event["name"].startswith("bucket ") else COLOURS.get(event["name"], "#999999")
            axes.barh(y, width, left=left, height=height, color=colour, edgecolor="#555555", linewidth=0.4)
            inside = start <= event["ts"] and event["ts"] + event["dur"] <= end
            if not parent and inside and width > (end - start) / 1000 * 0.08:
                axes.text(left + width / 2, y, event["name"], ha="center", va="center", fontsize=7)
    labels = [f"{names.get((pid, None), pid)} / {names.get((pid, tid), tid)}" for pid, tid in reversed(rows)]
    axes.set_yticks(range(len(rows)), labels, fontsize=8)
    axes.set_xlim(-margin / 1000, (end - start + margin) / 1000)
    axes.set_xlabel("ms since the step's forward began (rank 0)")
    axes.set_title(f"hpcddp timeline, step {args.step}: buckets reduce while backward still runs", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    axes.legend(handles, COLOURS, fontsize=7, ncol=len(COLOURS), loc="upper center", bbox_to_anchor=(0.5, -0.25))
    axes.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
