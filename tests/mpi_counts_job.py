"""Train a few steps of an 8-bucket model under DistributedOptimizer between MPI_Pcontrol(1) and (2).

Run by tests/test_mpi_counts.py with the counting library (tests/tools/mpi_counts.c) preloaded;
prints the number of buckets and the steps counted.
"""

import sys

import torch
from mpi4py import MPI

import hpcddp

COUNTED_STEPS = 10


def main() -> None:
    compression = sys.argv[1] if len(sys.argv) > 1 else "none"
    hpcddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    if compression == "reproducible":
        options = {"reproducible": True}
    else:
        options = {"compression": None if compression == "none" else compression}
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model.named_parameters(),
        bucket_cap_mb=0.25,
        first_bucket_mb=0.25,
        **options,
    )
    x = torch.randn(16, 256)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    for _ in range(3):  # past the first reduction's bookkeeping
        step()
    MPI.Pcontrol(1)
    for _ in range(COUNTED_STEPS):
        step()
    MPI.Pcontrol(2)
    if hpcddp.rank() == 0:
        print(f"buckets {len(optimizer.buckets)} steps {COUNTED_STEPS}")
    optimizer.close()


if __name__ == "__main__":
    main()
