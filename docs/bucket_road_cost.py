"""Host cost per gradient bucket: hpcddp's road (hook, launch, engine, wait) against raw mpi4py.

A model of N small layers, one bucket each (so the per-bucket cost is not hidden behind
the data), trained with hpcddp.DistributedOptimizer, against the same backward followed by
one in-place ``MPI_Allreduce`` per gradient from the training thread. The two take turns
step by step; the medians of the slowest rank are compared. Run at 2 ranks:
    mpirun -np 2 python docs/bucket_road_cost.py 64
"""

import sys
import time

import numpy as np
import torch

import hpcddp


def main(num_layers: int = 64, steps: int = 400) -> None:
    hpcddp.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    one_layer_mb = 16 * 16 * 4 / 2**20
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(num_layers)])
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model.named_parameters(),
        bucket_cap_mb=one_layer_mb,
        first_bucket_mb=one_layer_mb,
    )
    assert len(optimizer.reducer.buckets) == num_layers
    reference = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(num_layers)])
    plain = torch.optim.SGD(reference.parameters(), lr=0.0)
    x = torch.randn(4, 16)

    def hpcddp_step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    def raw_step() -> None:
        plain.zero_grad()
        reference(x).sum().backward()
        for param in reversed(list(reference.parameters())):
            grad = param.grad.numpy()
            comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
            grad /= comm.size
        plain.step()

    samples: dict[str, list[float]] = {"hpcddp": [], "raw": []}
    pair = [("hpcddp", hpcddp_step), ("raw", raw_step)]
    for step in range(steps):
        for name, run in pair if step % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(times[steps // 8 :])) * 1e6 for name, times in samples.items()}
    every = comm.gather(medians)
    if comm.rank == 0:
        ours, raw = (max(m[name] for m in every) for name in ("hpcddp", "raw"))
        print(
            f"{num_layers} buckets: hpcddp step {ours:.0f} us, raw mpi4py {raw:.0f} us, "
            f"hpcddp's extra cost per bucket {(ours - raw) / num_layers:.1f} us"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
