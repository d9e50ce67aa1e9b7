"""Host cost per gradient bucket: hpcddp's road (hook, launch, engine, wait) against raw mpi4py.

A model of N small layers, one bucket each (so the per-bucket cost is not hidden behind
the data), trained with hpcddp.DistributedOptimizer, against the same backward followed by
one in-place ``MPI_Allreduce`` per gradient from the training thread. The two take turns
step by step; the medians of the slowest rank are compared. Run at 2 ranks:
    mpirun -np 2 python docs/bucket_road_cost.py 64
"""

import sys
import time
from collections.abc import Callable

import numpy as np
import torch

import hpcddp

LAYER_WIDTH = 16


def layers(num_layers: int) -> torch.nn.Sequential:
    """The model: ``num_layers`` bias-free 16x16 layers, the same weights at every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(LAYER_WIDTH, LAYER_WIDTH, bias=False) for _ in range(num_layers)])


def hpcddp_and_raw_steps(num_layers: int, comm, x: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """Return (hpcddp's step with one bucket per layer, the raw step: backward, then one Allreduce per gradient)."""
    from mpi4py import MPI

    one_layer_mb = LAYER_WIDTH * LAYER_WIDTH * 4 / 2**20
    model = layers(num_layers)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model.named_parameters(),
        bucket_cap_mb=one_layer_mb,
        first_bucket_mb=one_layer_mb,
    )
    assert len(optimizer.reducer.buckets) == num_layers

    def hpcddp_step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    reference = layers(num_layers)
    plain = torch.optim.SGD(reference.parameters(), lr=0.0)

    def raw_step() -> None:
        plain.zero_grad()
        reference(x).sum().backward()
        for param in reversed(list(reference.parameters())):
            grad = param.grad.numpy()
            comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
            grad /= comm.size
        plain.step()

    raw_step.model = reference  # the raw road's gradients, for the prototypes to compare with
    return hpcddp_step, raw_step


def time_in_turns(roads: list[tuple[str, Callable[[], None]]], steps: int, comm) -> dict[str, float]:
    """Run the roads in turns (a new first one each step); return each one's median step, us, slowest rank."""
    samples: dict[str, list[float]] = {name: [] for name, _ in roads}
    for step in range(steps):
        for name, run in roads[step % len(roads) :] + roads[: step % len(roads)]:
            comm.Barrier()
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(times[steps // 8 :])) * 1e6 for name, times in samples.items()}
    every = comm.allgather(medians)
    return {name: max(m[name] for m in every) for name in medians}


def main(num_layers: int = 64, steps: int = 400) -> None:
    hpcddp.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    torch.set_num_threads(1)
    hpcddp_step, raw_step = hpcddp_and_raw_steps(num_layers, comm, torch.randn(4, LAYER_WIDTH))
    slowest = time_in_turns([("hpcddp", hpcddp_step), ("raw", raw_step)], steps, comm)
    if comm.rank == 0:
        ours, raw = slowest["hpcddp"], slowest["raw"]
        print(
            f"{num_layers} buckets: hpcddp step {ours:.0f} us, raw mpi4py {raw:.0f} us, "
            f"hpcddp's extra cost per bucket {(ours - raw) / num_layers:.1f} us"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
