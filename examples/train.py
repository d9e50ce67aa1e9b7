"""Train a small CNN on scikit-learn's 8x8 digits, data-parallel with hpcddp.

    python examples/train.py                                   # one process
    mpirun -np 2 python examples/train.py                      # two MPI ranks
    hpcddp run -np 4 examples/train.py                         # adds --oversubscribe if ranks > cores

The digits ship inside scikit-learn, so nothing is downloaded. The global batch is
fixed (--batch-size) and split evenly over the ranks, so 1 and N ranks take the
same optimisation steps on the same samples and end with the same loss.

With --checkpoint-dir (default $HPCDDP_CHECKPOINT_DIR, which slurm/train.sh sets) the
run resumes from the newest checkpoint there, mid-epoch if need be, and ends with
the same parameters as a run that was never interrupted. A checkpoint of another run
(HPCDDP_RUN_ID) or of another number of ranks is refused unless HPCDDP_RESUME allows
it: the position here counts global batches, which DistributedSampler deals out the
same way at any number of ranks, so HPCDDP_RESUME=any-size continues on the same
samples (dropout, if any, then draws other numbers). On SIGUSR1 or SIGTERM
(Slurm's warning before a time limit or preemption) all ranks stop at the same
step, save a checkpoint, requeue the Slurm job and exit with code 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field

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
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="parameter and data precision; float64 makes runs on different rank counts agree to rounding",
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout before the last layer (draws per rank)")
    parser.add_argument(
        "--compression",
        choices=("none", "fp16", "bf16", "powersgd", "int8"),
        default="none",
        help="gradients' dtype on the wire, or PowerSGD / int8 compression with error feedback",
    )
    parser.add_argument("--json", metavar="PATH", help="write final metrics here (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("HPCDDP_CHECKPOINT_DIR") or None,
        help="save checkpoints here and resume from the newest one (default $HPCDDP_CHECKPOINT_DIR)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="also checkpoint every N steps (0: only when stopped)",
    )
    parser.add_argument("--keep-last", type=int, default=3, metavar="K", help="checkpoints to keep")
    parser.add_argument("--save-final", metavar="PATH", help="save the final model state_dict here (rank 0)")
    parser.add_argument("--slow", type=float, default=0.0, metavar="SECONDS", help="sleep after every step (for tests)")
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=0,
        metavar="N",
        help="act as if SIGUSR1 arrived after step N (for tests)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    for name in ("checkpoint_every", "stop_after_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.keep_last < 1:
        parser.error(f"--keep-last must be >= 1, got {args.keep_last}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.slow < 0:
        parser.error(f"--slow must be >= 0, got {args.slow}")
    return args


def load_digits(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, test) datasets of 1x8x8 images scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as err:
        raise ImportError("examples/train.py needs scikit-learn: pip install scikit-learn") from err
    digits = sk_load_digits()
    images = torch.tensor(digits.images, dtype=dtype).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    images, labels = images[order].to(device), labels[order].to(device)
    train = TensorDataset(images[:NUM_TRAIN], labels[:NUM_TRAIN])
    test = TensorDataset(images[NUM_TRAIN:], labels[NUM_TRAIN:])
    return train, test


class DigitsNet(torch.nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers. No batch norm and, by
    default, no dropout, so the result does not depend on how the global batch is split."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.dropout = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(self.dropout(F.relu(self.fc1(x.flatten(1)))))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TensorDataset) -> tuple[float, float]:
    """Return (mean loss, accuracy) on the whole dataset."""
    images, labels = data.tensors
    logits = model(images)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item()


def progress(iterable, enabled: bool, **kwargs):
    # Bars redrawn with carriage returns garble Slurm's log files: only on a terminal.
    # The per-epoch line is printed either way.
    if not enabled or not (sys.stdout.isatty() and sys.stderr.isatty()):
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, leave=False, **kwargs)


@dataclass
class Position:
    """How far training got: ``batch`` batches of ``epoch`` done, ``step`` steps in all."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    #: this rank's (sum of losses, number of batches) so far in ``epoch``
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(2))


# Arguments that decide which samples a step sees or how it computes: a resume with
# other values would silently train on other batches.
RESUME_MUST_MATCH = ("batch_size", "seed", "dtype", "dropout")


def resume(args, model, optimizer, num_batches: int) -> Position | None:
    """Restore the newest checkpoint in --checkpoint-dir; None when there is none."""
    state = hpcddp.load_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if state is None:
        return None
    # First: a checkpoint of another run or another number of ranks is refused here, before
    # its arguments are compared with ours (HPCDDP_RESUME=any-run/any-size/any allows it).
    try:
        resumed = hpcddp.restore_training_state(state, model, optimizer)
    except ValueError as err:  # the same on every rank: one line each, no traceback
        raise SystemExit(f"cannot resume from {args.checkpoint_dir}: {err}") from None
    for name in RESUME_MUST_MATCH:
        saved = state["extra"].get(name)
        if saved is not None and saved != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise SystemExit(
                f"{flag} {getattr(args, name)} differs from the {saved} the checkpoint in {args.checkpoint_dir} was "
                f"trained with: resume with {flag} {saved}, or start afresh with another --checkpoint-dir"
            )
    sums, rank, size = resumed.extra["loss_sums"].cpu(), hpcddp.rank(), hpcddp.size()
    # Saved with another number of ranks: rank 0 carries the whole sum.
    loss_sum = sums[rank].clone() if len(sums) == size else sums.sum(0) if rank == 0 else torch.zeros(2)
    log.info(
        "resumed from step %d (epoch %d, batch %d of %d)",
        resumed.step,
        resumed.epoch,
        resumed.batch_in_epoch,
        num_batches,
    )
    return Position(resumed.epoch, resumed.batch_in_epoch, resumed.step, loss_sum)


def save(args, model, optimizer, position: Position) -> None:
    """Checkpoint ``position`` into --checkpoint-dir (on every rank: it is a collective)."""
    # Every rank's loss sum, so that a resumed epoch reports the same train loss.
    extra = {"loss_sums": hpcddp.allgather(position.loss_sum.unsqueeze(0))}
    extra.update({name: getattr(args, name) for name in RESUME_MUST_MATCH})
    state = hpcddp.training_state(
        model, optimizer, epoch=position.epoch, batch_in_epoch=position.batch, step=position.step, extra=extra
    )
    path = hpcddp.save_checkpoint(args.checkpoint_dir, state, keep_last=args.keep_last)
    log.info("checkpoint at step %d: %s", position.step, path)


def train(args, model, optimizer, sampler, data, test, position: Position, preemption) -> bool:
    """Train from ``position`` to the last epoch; return False if a stop signal ended it early."""
    rank_batch = args.batch_size // hpcddp.size()
    saved_step = position.step
    for epoch in range(position.epoch, args.epochs):
        if epoch != position.epoch:
            position.epoch, position.batch, position.loss_sum = epoch, 0, torch.zeros(2)
        sampler.set_epoch(epoch)
        # The sampler's order depends only on (seed, epoch): a resumed epoch drops the
        # batches it already did and goes on with the same batches as the first run.
        indices = list(sampler)[position.batch * rank_batch :]
        # A generator of its own: each new DataLoader iterator draws a seed from it, which,
        # from the global RNG, would shift a resumed run's dropout masks by one draw.
        loader = DataLoader(data, batch_size=rank_batch, sampler=indices, drop_last=True, generator=torch.Generator())
        model.train()
        for images, labels in progress(loader, hpcddp.rank() == 0 and not args.quiet, desc=f"epoch {epoch}"):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            position.loss_sum += torch.tensor([loss.item(), 1.0])
            position.batch += 1
            position.step += 1
            if position.step == args.stop_after_steps:
                preemption.request()
            if args.slow:
                time.sleep(args.slow)
            stop = preemption.should_stop()
            if args.checkpoint_dir and (stop or (args.checkpoint_every and position.step % args.checkpoint_every == 0)):
                save(args, model, optimizer, position)
                saved_step = position.step
            if stop:
                return False
        train_loss = hpcddp.allreduce(position.loss_sum, op="sum")
        test_loss, accuracy = evaluate(model.eval(), test)
        log.info(
            "epoch %2d  train loss %.4f  test loss %.4f  test accuracy %.2f%%",
            epoch,
            train_loss[0] / train_loss[1],
            test_loss,
            100 * accuracy,
        )
    if args.checkpoint_dir and position.step != saved_step:
        # A finished run started again (e.g. requeued after a node failure) then has nothing left to do.
        save(args, model, optimizer, position)
    return True


def main(argv=None) -> dict:
    args = parse_args(argv)
    hpcddp.init(backend=args.backend)
    rank, size = hpcddp.rank(), hpcddp.size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    if args.batch_size % size:
        raise SystemExit(f"--batch-size must be divisible by the number of ranks ({size}), got {args.batch_size}")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    # Every rank reports where it runs; rank 0 prints the lot (logging on rank 0 only).
    for other, host in hpcddp.allgather_object((rank, socket.gethostname())):
        log.info("rank %d/%d on %s, backend %s, restart %s", other, size, host, hpcddp.backend(), restarts)
    device = hpcddp.device()
    dtype = getattr(torch, args.dtype)
    data, test = load_digits(device, dtype)
    sampler = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)

    torch.manual_seed(args.seed)
    model = DigitsNet(args.dropout).to(device, dtype)
    # Each rank's own random stream for training (dropout masks); checkpoints keep it.
    torch.manual_seed(args.seed + 1 + rank)
    hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        model.named_parameters(),
        compression=None if args.compression == "none" else args.compression,
    )
    log.info(
        "training on %d rank(s), backend %s, device %s, global batch %d",
        size,
        hpcddp.backend(),
        device,
        args.batch_size,
    )
    position = resume(args, model, optimizer, len(sampler) // (args.batch_size // size)) or Position()

    start = time.perf_counter()
    # Held until the end: the SIGTERM with which Slurm ends a requeued run must not kill a rank mid-shutdown.
    with hpcddp.PreemptionHandler(checkpoint_dir=args.checkpoint_dir) as preemption:
        completed = train(args, model, optimizer, sampler, data, test, position, preemption)
        test_loss, accuracy = evaluate(model.eval(), test)
        metrics = {
            "world_size": size,
            "epochs": args.epochs,
            "step": position.step,
            "completed": completed,
            "test_loss": test_loss,
            "test_accuracy": accuracy,
            "seconds": time.perf_counter() - start,
        }
        if completed:
            log.info("done: test accuracy %.2f%% in %.1f s", 100 * accuracy, metrics["seconds"])
            if args.save_final and rank == 0:
                torch.save(model.state_dict(), args.save_final)
        else:
            # Said before the requeue: Slurm may end the job (and its output) the moment it is requeued.
            log.info("stopped at step %d", position.step)
            preemption.requeue()
        if args.json and rank == 0:
            with open(args.json, "w") as fh:
                json.dump(metrics, fh, indent=2)
        optimizer.close()
        hpcddp.shutdown()
    return metrics


if __name__ == "__main__":
    main()
