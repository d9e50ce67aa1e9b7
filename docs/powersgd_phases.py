"""Where a PowerSGD step goes, rank by rank: the phases of the bench's MLP step against a local step.

Alternates a plain SGD step (no communication) and a step through
``hpcddp.DistributedOptimizer(compression=hpcddp.PowerSGD(start_powerSGD_iter=0))``, 10 timed
steps each (after 2 untimed), a barrier before every step, and prints per rank the median
milliseconds since the step began at which each phase started and ended: the forward, each
bucket's compression launch, second stage (QR and Q = M^T P) and decompression, the end of
backward (the reduction's waits included), and the step. ``nocheck`` as the first argument turns the agreement before each
collective off (``hpcddp.init(check_collectives=False)``).

    VCLUSTER_SLOTS=1 bash slurm/testing/virtual_cluster.sh run --nodes 2 --rate 1gbit python docs/powersgd_phases.py
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import hpcddp
from hpcddp.bench.models import build_workload
from hpcddp.ddp.compression import powersgd

STEPS, WARMUP = 10, 2
marks: dict[str, float] = {}


def timed(method: str, label: str) -> None:
    """Record when ``_PowerSGDCodec.<method>`` first starts and ends in a step, per bucket."""
    original = getattr(powersgd._PowerSGDCodec, method)

    def wrapper(self, *args, **kwargs):
        index = self.bucket.index
        marks.setdefault(f"{label}{index}", time.perf_counter())
        try:
            return original(self, *args, **kwargs)
        finally:
            marks.setdefault(f"{label}{index}_end", time.perf_counter())

    setattr(powersgd._PowerSGDCodec, method, wrapper)


def run(model: torch.nn.Module, workload, compressed: bool) -> dict[str, float]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if compressed:
        compression = hpcddp.PowerSGD(start_powerSGD_iter=0)
        optimizer = hpcddp.DistributedOptimizer(optimizer, model.named_parameters(), compression=compression)
    rows = []
    for step in range(WARMUP + STEPS):
        hpcddp.barrier()
        marks.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = workload.loss(model)
        marks["forward_end"] = time.perf_counter()
        loss.backward()
        marks["backward_end"] = time.perf_counter()
        optimizer.step()
        marks["step_end"] = time.perf_counter()
        if step >= WARMUP:
            rows.append({name: (t - start) * 1e3 for name, t in marks.items()})
    if compressed:
        optimizer.close()
    return {name: round(statistics.median(row[name] for row in rows), 1) for name in rows[0]}


def main() -> None:
    hpcddp.init(check_collectives=sys.argv[1:2] != ["nocheck"])
    torch.set_num_threads(1)
    for method, label in (("launch", "launch"), ("_second_stage", "stage2_"), ("_decompress", "decompress")):
        timed(method, label)
    workload = build_workload("mlp", 32, seed=hpcddp.rank())
    phases = {"local": [], "powersgd": []}
    for _ in range(2):
        phases["local"].append(run(workload.model, workload, compressed=False))
        phases["powersgd"].append(run(workload.model, workload, compressed=True))
    for name, rounds in phases.items():
        ordered = sorted(rounds[-1].items(), key=lambda item: item[1])
        print(f"rank {hpcddp.rank()} {name:8s} " + " ".join(f"{k}={v}" for k, v in ordered), flush=True)


if __name__ == "__main__":
    main()
