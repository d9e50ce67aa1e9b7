"""Train a small CNN on scikit-learn's 8x8 digits, data-parallel with hpcddp.

    python examples/train.py                                   # one process
    mpirun -np 2 python examples/train.py                      # two MPI ranks
    hpcddp run -np 8 examples/train.py --epochs 5              # oversubscribed is fine

The digits ship inside scikit-learn, so nothing is downloaded. The global batch is
fixed (--batch-size) and split evenly over the ranks, so 1 and N ranks take the
same optimisation steps on the same samples and end with the same loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hpcddp

log = logging.getLogger("train")

# 1440 training digits: divisible by every world size up to 32 that divides the
# batch, so DistributedSampler neither pads nor drops samples.
NUM_TRAIN = 1440


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="auto, mpi, gloo or nccl")
    parser.add_argument("--json", metavar="PATH", help="write final metrics here (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    return args


def load_digits(device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, test) datasets of 1x8x8 images scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as err:
        raise ImportError("examples/train.py needs scikit-learn: pip install scikit-learn") from err
    digits = sk_load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    images, labels = images[order].to(device), labels[order].to(device)
    train = TensorDataset(images[:NUM_TRAIN], labels[:NUM_TRAIN])
    test = TensorDataset(images[NUM_TRAIN:], labels[NUM_TRAIN:])
    return train, test


class DigitsNet(torch.nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers (no dropout, no batch norm,
    so the result does not depend on how the global batch is split)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TensorDataset) -> tuple[float, float]:
    """Return (mean loss, accuracy) on the whole dataset."""
    images, labels = data.tensors
    logits = model(images)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item()


def progress(iterable, enabled: bool, **kwargs):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, leave=False, **kwargs)


def main(argv=None) -> dict:
    args = parse_args(argv)
    hpcddp.init(backend=args.backend)
    rank, size = hpcddp.rank(), hpcddp.size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    if args.batch_size % size:
        raise SystemExit(f"--batch-size must be divisible by the number of ranks ({size}), got {args.batch_size}")
    device = hpcddp.device()
    train, test = load_digits(device)
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size // size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = DigitsNet().to(device)
    hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model.named_parameters()
    )
    log.info("training on %d rank(s), backend %s, device %s, global batch %d", size, hpcddp.backend(), device, args.batch_size)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2)
        for images, labels in progress(loader, rank == 0 and not args.quiet, desc=f"epoch {epoch}"):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
        train_loss = hpcddp.allreduce(total, op="sum")
        test_loss, accuracy = evaluate(model.eval(), test)
        log.info("epoch %2d  train loss %.4f  test loss %.4f  test accuracy %.2f%%", epoch, train_loss[0] / train_loss[1], test_loss, 100 * accuracy)

    metrics = {
        "world_size": size,
        "epochs": args.epochs,
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
    }
    log.info("done: test accuracy %.2f%% in %.1f s", 100 * accuracy, metrics["seconds"])
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(metrics, fh, indent=2)
    optimizer.close()
    hpcddp.shutdown()
    return metrics


if __name__ == "__main__":
    main()
