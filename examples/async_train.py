"""Asynchronous model averaging on scikit-learn's 8x8 digits: no rank waits for a slower one.

    hpcddp run -np 4 examples/async_train.py --slow-ms 30 --seconds 8   # the last rank sleeps 30 ms a step

Each rank steps its own plain SGD optimizer on its shard of the digits while
hpcddp.AsyncModelAverager averages the model with the other ranks in the background;
close() ends with one synchronous average, so every rank holds the same model. With
--jitter-ms every rank sleeps a random time after each step (a shared node's noise: a
synchronous job waits for the slowest rank at every step); with --slow-ms the last
rank sleeps that long after each step (a straggler), and --seconds lets every rank
train for the same wall time instead of the same number of epochs, so the fast ranks
take more steps (without --seconds: 12 epochs on every rank). Data and model are
examples/train.py's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from train import DigitsNet, evaluate, load_digits

import hpcddp

log = logging.getLogger("async_train")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12, help="epochs per rank (unless --seconds)")
    parser.add_argument("--seconds", type=float, default=0.0, help="train this long on every rank instead (0: off)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=0, help="steps averaged synchronously first")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="every rank sleeps up to this long after a step")
    parser.add_argument("--slow-ms", type=float, default=0.0, help="the last rank sleeps this long after a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write final metrics here (rank 0)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    for name in ("seconds", "warmup_steps", "jitter_ms", "slow_ms"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
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
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Starts every rank from rank 0's weights; from here on optimizer.step() also averages.
    averager = hpcddp.AsyncModelAverager(model, optimizer, warmup_steps=args.warmup_steps)
    delays = random.Random(args.seed * 1000 + rank)
    pause = (args.slow_ms if rank == size - 1 else 0.0) / 1e3

    start, steps = time.perf_counter(), 0
    epochs = itertools.count() if args.seconds else range(args.epochs)
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            steps += 1
            time.sleep(pause + delays.uniform(0, args.jitter_ms / 1e3))
            if args.seconds and time.perf_counter() - start >= args.seconds:
                break
        # Rank 0's own model, without a collective (a checkpoint would go in `with averager.paused():`).
        log.info("epoch %2d  rank 0: %d steps, test accuracy %.2f%%", epoch, steps, 100 * evaluate(model, test)[1])
        if args.seconds and time.perf_counter() - start >= args.seconds:
            break
    averager.close()  # waits for the other ranks, then one synchronous average
    test_loss, accuracy = evaluate(model.eval(), test)
    metrics = {
        "world_size": size,
        "steps_per_rank": hpcddp.allgather_object(steps),
        "rounds": averager.num_rounds,
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
    }
    log.info("steps per rank %s, %d rounds of averaging", metrics["steps_per_rank"], metrics["rounds"])
    log.info("done: test accuracy %.2f%% in %.1f s", 100 * accuracy, metrics["seconds"])
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(metrics, fh, indent=2)
    hpcddp.shutdown()
    return metrics


if __name__ == "__main__":
    main()
