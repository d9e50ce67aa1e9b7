"""Time Horovod's training step on hpcddp bench's MLP, in a job of its own (no hpcddp in the process).

Real Horovod and hpcddp in one process hang across the virtual nodes once a link is
rate-limited (docs/BENCHMARKS.md, "Across nodes"), so ``hpcddp bench train`` cannot run
Horovod beside its other variants there; docs/across_nodes.sh alternates this job with
the bench's jobs instead. Same workload, optimizer, thread count and timing rule as
``hpcddp bench train``: the median of ``--steps`` timed steps after ``--warmup``, the
slowest rank, the median over ``--repeats`` rounds.

    mpirun -np 4 python docs/horovod_step.py --json horovod.json   # needs horovod.torch
"""

from __future__ import annotations

import argparse
import json

import horovod.torch as hvd
import torch

from hpcddp.bench.metrics import median
from hpcddp.bench.models import build_workload
from hpcddp.bench.train import _time_run as time_run  # the bench's timing rule, so both measure alike


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    workload = build_workload(args.model, args.batch_size, seed=hvd.rank())
    model = workload.model
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step():
        optimizer.zero_grad()
        workload.loss(model).backward()
        optimizer.step()

    rounds = [max(hvd.allgather_object(time_run(step, args.steps, args.warmup))) * 1e3 for _ in range(args.repeats)]
    if hvd.rank() == 0:
        result = {"variant": "horovod", "step_ms": median(rounds), "runs_ms": rounds}
        print(json.dumps(result))
        if args.json:  # the layout of `hpcddp bench train --json`, which docs/render_across_nodes.py reads
            with open(args.json, "w") as out:
                json.dump({"benchmark": "horovod_step", "world_size": hvd.size(), "results": [result]}, out, indent=2)


if __name__ == "__main__":
    main()
