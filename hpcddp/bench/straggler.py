"""Straggler tolerance (``hpcddp bench straggler``): time to a test accuracy when one rank is slow.

Every rank trains the same MLP on its shard of scikit-learn's 8x8 digits (``batch_size``
samples per step, SGD with momentum) for ``seconds`` of wall time. After each step's
compute a rank pauses ``pause_ms`` (the last rank ``factor`` times as long: the
straggler), plus a random delay of up to ``jitter_ms`` on every rank. Variants:

- ``sync``: ``hpcddp.DistributedOptimizer`` (gradients averaged every step);
- ``local-sgd``: local steps, ``hpcddp.PeriodicModelAverager(period)``;
- ``async``: local steps, ``hpcddp.AsyncModelAverager``.

Rank 0 copies its model every ``eval_every_s`` seconds; the copies are evaluated on the
test digits after the run, so evaluation costs no training time. The time to the target
is the first copy at or above it; the final accuracy is that of the model every rank
holds at the end (after the last average). Repeats run every variant in turn (sync,
local-sgd, async, sync, ...) so that load on a shared machine falls on all alike.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import hpcddp

__all__ = ["VARIANTS", "StragglerConfig", "StragglerRun", "bench_straggler", "digits_mlp", "load_digits", "summarize"]

VARIANTS = ("sync", "local-sgd", "async")


@dataclass(kw_only=True)
class StragglerConfig:
    """One ``hpcddp bench straggler`` measurement."""

    variants: tuple[str, ...] = VARIANTS
    """which of ``VARIANTS`` to run, in that order each repeat"""
    factor: float = 3.0
    """the last rank's pause after each step, as a multiple of the others' (1: no straggler)"""
    pause_ms: float = 10.0
    """the other ranks' pause after each step's compute (stands for more compute)"""
    jitter_ms: float = 0.0
    """a random delay of up to this much after every step, on every rank"""
    seconds: float = 10.0
    """wall time each run trains"""
    target: float = 0.95
    """the test accuracy whose first crossing is timed"""
    repeats: int = 3
    """runs of every variant"""
    batch_size: int = 32
    """samples per rank per step"""
    lr: float = 0.1
    """SGD's learning rate (momentum 0.9), for every variant"""
    period: int = 4
    """steps between averages of the local-sgd variant"""
    eval_every_s: float = 0.1
    """seconds between the copies of rank 0's model that make the curve"""
    seed: int = 0
    """seeds the weights (the same on every rank), the shuffling and the delays"""

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got {', '.join(self.variants) or 'none'}")
        for name in ("factor", "seconds", "eval_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("pause_ms", "jitter_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be an accuracy in (0, 1], got {self.target}")
        for name in ("repeats", "batch_size", "period"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class StragglerRun:
    """One run of one variant (figures from rank 0, steps from every rank)."""

    variant: str
    repeat: int
    #: seconds until rank 0's model first reached the target accuracy; None: not within the run
    seconds_to_target: float | None
    #: test accuracy of the model every rank holds at the end
    final_accuracy: float
    #: steps each rank took, in rank order
    steps: list[int]
    #: steps per second of each rank but the straggler (every rank when there is one)
    fast_steps_per_s: float
    #: (seconds, test accuracy) of rank 0's model during the run
    curve: list[tuple[float, float]] = field(default_factory=list)


def load_digits(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Return (train images, train labels, test images, test labels): 1440 / 357 flat 8x8 digits in [0, 1].

    The split is examples/train.py's (a fixed permutation, the first 1440 to train).
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as err:
        raise ImportError("hpcddp bench straggler needs scikit-learn: pip install scikit-learn") from err
    digits = sk_load_digits()
    images = torch.tensor(digits.data, dtype=dtype) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    images, labels = images[order], labels[order]
    return images[:1440], labels[:1440], images[1440:], labels[1440:]


def digits_mlp(hidden: int = 128) -> torch.nn.Sequential:
    """Build the benchmark's MLP: 64 -> hidden -> hidden -> 10 with ReLUs (26k parameters by default)."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )  # fmt: skip


@torch.no_grad()
def _accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    return (model(images).argmax(1) == labels).float().mean().item()


def _batches(images, labels, batch_size: int, seed: int):
    """This rank's shard, reshuffled every epoch, in batches, forever."""
    rank, size = hpcddp.rank(), hpcddp.size()
    shard_x, shard_y = images[rank::size], labels[rank::size]
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        order = torch.randperm(len(shard_y), generator=generator)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            chosen = order[i : i + batch_size]
            yield shard_x[chosen], shard_y[chosen]


def _agreed(flag: bool) -> bool:
    """True on every rank when any rank says True (for the variants whose ranks step together)."""
    return hpcddp.allreduce(torch.tensor([float(flag)]), op="max").item() > 0


def _run(variant: str, config: StragglerConfig, data, repeat: int) -> StragglerRun:
    train_x, train_y, test_x, test_y = data
    rank, size = hpcddp.rank(), hpcddp.size()
    torch.manual_seed(config.seed)
    model = digits_mlp()
    optimizer = local = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    averager = None
    if variant == "sync":
        optimizer = hpcddp.DistributedOptimizer(local, model.named_parameters())
    elif variant == "local-sgd":
        averager = hpcddp.PeriodicModelAverager(config.period)
    else:
        averager = hpcddp.AsyncModelAverager(model, local)
    pause = config.pause_ms / 1e3 * (config.factor if rank == size - 1 else 1.0)
    delays = random.Random(config.seed * 1000 + rank)
    batches = _batches(train_x, train_y, config.batch_size, config.seed + repeat)
    copies: list[tuple[float, list[torch.Tensor]]] = []
    hpcddp.barrier()
    start, steps, next_copy = time.perf_counter(), 0, 0.0
    while True:
        x, y = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if variant == "local-sgd":
            averager.average_parameters(model.parameters())
        steps += 1
        time.sleep(pause + delays.uniform(0, config.jitter_ms / 1e3))
        now = time.perf_counter() - start
        if rank == 0 and now >= next_copy:
            copies.append((now, [p.detach().clone() for p in model.parameters()]))
            next_copy += config.eval_every_s
        over = now >= config.seconds
        if variant != "async":  # the ranks step together, so they stop together: agreed every period steps
            over = (steps - 1) % config.period == 0 and _agreed(over)
        if over:
            break
    elapsed = time.perf_counter() - start
    if variant == "sync":
        optimizer.close()
    elif variant == "local-sgd":
        with torch.no_grad():
            for param in model.parameters():
                hpcddp.allreduce_(param, op="average")
    else:
        averager.close()
    rates = hpcddp.allgather_object(steps / elapsed)
    fast = rates[:-1] if size > 1 and config.factor != 1 else rates
    scratch = digits_mlp()
    curve = []
    for seconds, params in copies:
        with torch.no_grad():
            torch._foreach_copy_(list(scratch.parameters()), params)
        curve.append((round(seconds, 3), _accuracy(scratch, test_x, test_y)))
    reached = next((seconds for seconds, accuracy in curve if accuracy >= config.target), None)
    final = _accuracy(model, test_x, test_y)
    return StragglerRun(variant, repeat, reached, final, hpcddp.allgather_object(steps), statistics.mean(fast), curve)


def bench_straggler(config: StragglerConfig, progress: Callable[[str], None] | None = None) -> list[StragglerRun]:
    """Run every variant ``config.repeats`` times, interleaved; every rank must call this.

    Args:
        config: what to measure.
        progress: called with a line after each repeat (on every rank).
    """
    data = load_digits()
    runs = []
    for repeat in range(config.repeats):
        done = [_run(variant, config, data, repeat) for variant in config.variants]
        runs += done
        if progress is not None:
            progress(
                f"repeat {repeat + 1}/{config.repeats}: "
                + ", ".join(f"{r.variant} {_seconds(r.seconds_to_target)}" for r in done)
            )
    return runs


def _seconds(value: float | None) -> str:
    return "target not reached" if value is None else f"{value:.2f} s to target"


def _median(values: list[float | None]) -> float | None:
    """The median, a run that never reached the target counting as slower than any that did."""
    middle = statistics.median(float("inf") if v is None else v for v in values)
    return None if middle == float("inf") else middle


def summarize(runs: list[StragglerRun]) -> list[dict]:
    """Return one row per variant: medians over its runs, and time to target relative to sync's.

    Args:
        runs: what ``bench_straggler`` returned.
    """
    rows = []
    for variant in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == variant]
        rows.append(
            {
                "variant": variant,
                "seconds_to_target": _median([r.seconds_to_target for r in mine]),
                "final_accuracy": statistics.median(r.final_accuracy for r in mine),
                "fast_steps_per_s": statistics.median(r.fast_steps_per_s for r in mine),
                "runs_seconds_to_target": [r.seconds_to_target for r in mine],
            }
        )
    sync = next((row for row in rows if row["variant"] == "sync"), None)
    for row in rows:
        row["vs_sync"] = None
        if sync and sync["seconds_to_target"] and row["seconds_to_target"] is not None:
            row["vs_sync"] = row["seconds_to_target"] / sync["seconds_to_target"]
    return rows
