"""Post-local SGD on scikit-learn's 8x8 digits: synchronous steps first, then local steps and averaging.

    mpirun -np 2 python examples/post_local_sgd.py                   # 60 synchronous steps, then average every 4
    hpcddp run -np 4 examples/post_local_sgd.py --period 8           # adds --oversubscribe if ranks > cores

For the first --sync-steps steps every gradient is averaged by hpcddp.DistributedOptimizer.
After that each rank steps alone on its own batches and hpcddp.PeriodicModelAverager
replaces the parameters by their average every --period steps: 1/period of the
communication. Data and model are examples/train.py's.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from train import DigitsNet, evaluate, load_digits

import hpcddp

log = logging.getLogger("post_local_sgd")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sync-steps", type=int, default=60, help="steps with averaged gradients first")
    parser.add_argument("--period", type=int, default=4, help="then average the parameters every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write final metrics here (rank 0)")
    args = parser.parse_args(argv)
    for name in ("epochs", "period"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.sync_steps < 0:
        parser.error(f"--sync-steps must be >= 0, got {args.sync_steps}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    hpcddp.init()
    rank, size = hpcddp.rank(), hpcddp.size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    if args.batch_size % size:
        raise SystemExit(f"--batch-size must be divisible by the number of ranks ({size}), got {args.batch_size}")
    data, test = load_digits(hpcddp.device())
    sampler = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size // size, sampler=sampler, drop_last=True)
    torch.manual_seed(args.seed)
    model = DigitsNet().to(hpcddp.device())
    hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
    local = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hpcddp.DistributedOptimizer(local, model.named_parameters())
    averager = hpcddp.PeriodicModelAverager(period=args.period, warmup_steps=args.sync_steps)

    start, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            if step == args.sync_steps:
                optimizer.close()  # from here on each rank steps alone, keeping its momentum
                optimizer = local
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            averager.average_parameters(model.parameters())
            step += 1
        log.info("epoch %2d  test accuracy %.2f%% (rank 0's model)", epoch, 100 * evaluate(model.eval(), test)[1])
        model.train()
    # End on the average, whatever step the last one was.
    with torch.no_grad():
        for param in model.parameters():
            hpcddp.allreduce_(param, op="average")
    test_loss, accuracy = evaluate(model.eval(), test)
    metrics = {
        "world_size": size,
        "steps": step,
        "sync_steps": args.sync_steps,
        "period": args.period,
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
    }
    log.info("done: test accuracy %.2f%% in %.1f s", 100 * accuracy, metrics["seconds"])
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(metrics, fh, indent=2)
    hpcddp.shutdown()
    return metrics


if __name__ == "__main__":
    main()
