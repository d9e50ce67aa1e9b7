"""Small blocking allreduce latency: hpcddp beside raw mpi4py, torch.distributed on hpcddp's backend, and gloo."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

import hpcddp

from .allreduce import available_paths, mpi_comm
from .metrics import median

__all__ = ["LATENCY_PATHS", "LatencyResult", "available_latency_paths", "latency_as_dicts", "measure_latency"]

#: every path, in the order columns are printed: ``hpcddp.allreduce_``; mpi4py's
#: ``Allreduce(IN_PLACE, ...)`` on numpy; the MPI floor of a checked allreduce (mpi4py: the
#: agreement's ``Iallreduce`` of 5 int64, waited for, then that ``Allreduce``: what hpcddp's
#: MPI calls cost without its Python); ``dist.all_reduce`` on a group of hpcddp's torch backend
#: (the one registered as "mpi" and "hpcddp"); ``dist.all_reduce`` on gloo
LATENCY_PATHS = ("hpcddp", "mpi4py", "mpi-floor", "torch-mpi", "gloo")


@dataclass
class LatencyResult:
    """One path: the median microseconds of one blocking allreduce, slowest rank, and its ratio to mpi4py's."""

    path: str
    count: int
    time_us: float
    vs_mpi4py: float | None


def available_latency_paths(requested: Sequence[str] = LATENCY_PATHS) -> list[str]:
    """Return the requested paths that can run here (mpi4py and mpi-floor need ranks started by MPI).

    Args:
        requested: names from ``LATENCY_PATHS``.
    """
    return available_paths(requested, LATENCY_PATHS)


def _runner(path: str, count: int) -> tuple[Callable[[], None], torch.Tensor]:
    """Return (one blocking sum-allreduce on ``path``, the tensor it reduces)."""
    tensor = torch.zeros(count, dtype=torch.float32)
    if path == "hpcddp":
        return (lambda: hpcddp.allreduce_(tensor, op="sum")), tensor
    if path in ("mpi4py", "mpi-floor"):
        from ..env.mpi_import import import_mpi

        MPI = import_mpi()
        comm = mpi_comm().Dup()  # its own, so its messages never pair with hpcddp's
        array = tensor.numpy()
        if path == "mpi4py":
            return (lambda: comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)), tensor
        agreement, agreed = np.zeros(5, dtype=np.int64), np.empty(5, dtype=np.int64)

        def checked() -> None:
            comm.Iallreduce(agreement, agreed, op=MPI.MIN).Wait()
            comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)

        return checked, tensor
    import torch.distributed as dist

    from ._torchdist import ensure_process_group, hpcddp_process_group

    if path == "torch-mpi":
        group = hpcddp_process_group()
    else:
        ensure_process_group()
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return (lambda: dist.all_reduce(tensor, group=group)), tensor


def measure_latency(
    count: int = 8, iters: int = 2000, rounds: int = 5, warmup: int = 50, paths: Sequence[str] = LATENCY_PATHS
) -> list[LatencyResult]:
    """Time a blocking float32 sum-allreduce of ``count`` elements on each path; every rank must call this.

    The paths take turns in rounds (the order reversed every round), so the machine's
    load falls on each alike; each call is timed alone and the median of all calls taken,
    then the slowest rank's.

    Args:
        count: elements per allreduce.
        iters: timed calls per path, spread over the rounds.
        rounds: how many turns each path takes.
        warmup: untimed calls before each turn.
        paths: names from ``LATENCY_PATHS``; ones that cannot run here are skipped.
    """
    if count < 1 or iters < rounds or rounds < 1:
        raise ValueError(
            f"count must be >= 1 and iters >= rounds >= 1, got count={count} iters={iters} rounds={rounds}"
        )
    chosen = available_latency_paths(paths)
    runners = {path: _runner(path, count) for path in chosen}
    for path, (once, tensor) in runners.items():
        tensor.fill_(1.0)
        once()
        if not torch.all(tensor == hpcddp.size()):
            raise RuntimeError(f"{path} allreduce of ones gave {tensor[:8].tolist()}, expected {hpcddp.size()}")
        tensor.zero_()
    samples: dict[str, list[float]] = {path: [] for path in chosen}
    per_round = iters // rounds
    order = list(runners.items())
    for turn in range(rounds):
        for path, (once, _) in order if turn % 2 == 0 else reversed(order):
            for _ in range(warmup):
                once()
            hpcddp.barrier()
            times = np.empty(per_round)
            for i in range(per_round):
                start = time.perf_counter()
                once()
                times[i] = time.perf_counter() - start
            samples[path] += times.tolist()
    medians = {path: max(hpcddp.allgather_object(median(times))) * 1e6 for path, times in samples.items()}
    raw = medians.get("mpi4py")
    return [LatencyResult(path, count, us, None if raw is None else us / raw) for path, us in medians.items()]


def latency_as_dicts(results: Sequence[LatencyResult]) -> list[dict]:
    """Return the results as plain dicts for JSON."""
    return [asdict(r) for r in results]
