"""examples/train.py written the Horovod way, running on hpcddp through ``hpcddp.horovod``.

    mpirun -np 2 python examples/train_horovod.py

A Horovod script moves over by changing its import (``import horovod.torch as hvd``
becomes ``import hpcddp.horovod as hvd``); everything below is Horovod's API. With the
same arguments it ends with the same parameters as examples/train.py (Horovod sums
and then divides by size(), hpcddp divides first: the two agree to rounding).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from train import DigitsNet, evaluate, load_digits  # the model and data of examples/train.py

import hpcddp.horovod as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--json", metavar="PATH", help="write final metrics here (rank 0)")
    parser.add_argument("--save-final", metavar="PATH", help="save the final model state_dict here (rank 0)")
    args = parser.parse_args()

    hvd.init()
    if args.batch_size % hvd.size():
        raise SystemExit(f"--batch-size must be divisible by the number of ranks ({hvd.size()}), got {args.batch_size}")
    dtype = getattr(torch, args.dtype)
    data, test = load_digits(torch.device("cpu"), dtype)
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size // hvd.size(), sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = DigitsNet().to(dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
        train_loss = hvd.allreduce(loss.detach(), name="train_loss")
        test_loss, accuracy = evaluate(model.eval(), test)
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  last-batch loss {train_loss.item():.4f}  test accuracy {100 * accuracy:.2f}%")

    if hvd.rank() == 0:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world_size": hvd.size(), "test_loss": test_loss, "test_accuracy": accuracy}, fh)
        if args.save_final:
            torch.save(model.state_dict(), args.save_final)
    hvd.shutdown()


if __name__ == "__main__":
    main()
