"""The digits run of examples/train.py with torch DDP and torch's own PowerSGD hook instead of hpcddp's optimizer.

The accuracy reference for docs/BENCHMARKS.md's "Compression across nodes": same model, data,
sampler, learning rate, momentum and epochs; DDP over the ``hpcddp`` torch.distributed backend
with ``powerSGD_hook`` at rank 1, compressing from step 10 (hpcddp's PowerSGD default).

    hpcddp run -np 4 python docs/digits_ddp_powersgd.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import hpcddp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train import DigitsNet, evaluate, load_digits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix_approximation_rank")
    args = parser.parse_args()
    hpcddp.init()
    dist.init_process_group("hpcddp")
    rank, size = dist.get_rank(), dist.get_world_size()
    data, test = load_digits(torch.device("cpu"))
    sampler = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = DistributedDataParallel(DigitsNet())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=10)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=args.batch_size // size, sampler=sampler):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    loss, accuracy = evaluate(model.module.eval(), test)
    if rank == 0:
        print(f"DDP + powerSGD_hook (rank {args.rank}): test accuracy {100 * accuracy:.2f}%, test loss {loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
