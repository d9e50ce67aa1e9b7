"""Allreduce message-size sweep: hpcddp beside raw mpi4py and torch.distributed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

import hpcddp

from ..env.mpi_import import import_mpi, mpi_launcher_present
from .metrics import algbw, busbw, median

__all__ = [
    "OPS",
    "PATHS",
    "SPANS",
    "AllreduceResult",
    "available_paths",
    "mpi_comm",
    "path_label",
    "results_as_dicts",
    "sweep_allreduce",
]

#: every path the sweep knows, in the order columns are printed
PATHS = ("hpcddp", "mpi4py", "torch")

#: the reductions the sweep times: MPI's own, and hpcddp's default (a sum, then a division)
OPS = ("sum", "average")

#: which ranks reduce together: all of them, each node's ranks among themselves (all
#: nodes at once), or one rank per node (the links between nodes alone)
SPANS = ("world", "node", "between-nodes")


@dataclass
class AllreduceResult:
    """One path at one message size: the median time over iterations, slowest rank."""

    path: str
    size: int
    count: int
    time_us: float
    algbw: float
    busbw: float


def mpi_comm():
    comm = getattr(hpcddp.communicator(), "mpi_comm", None)
    if comm is not None:
        return comm
    if mpi_launcher_present(os.environ):
        return import_mpi().COMM_WORLD
    return None


def available_paths(requested: Sequence[str] = PATHS, known: Sequence[str] = PATHS) -> list[str]:
    """Return the requested paths that can run here (mpi4py needs ranks started by MPI).

    Args:
        requested: names from ``known``.
        known: the benchmark's paths (``PATHS``, or ``latency.LATENCY_PATHS``).
    """
    unknown = [p for p in requested if p not in known]
    if unknown:
        raise ValueError(f"paths must be among {', '.join(known)}, got {', '.join(unknown)}")
    return [p for p in requested if not p.startswith("mpi") or mpi_comm() is not None]


@dataclass
class _Group:
    """The ranks this rank reduces with for one span: their count, and per path the
    communicator (None on ranks left out of the span)."""

    size: int
    active: bool
    mpi: object = None
    hpcddp: object = None
    torch: object = None


def _span_group(span: str, paths: Sequence[str]) -> _Group:
    if span == "world":
        return _Group(hpcddp.size(), True)
    if span not in SPANS:
        raise ValueError(f"span must be one of {', '.join(SPANS)}, got {span!r}")
    nodes = hpcddp.allgather_object(hpcddp.node_rank())
    locals_ = hpcddp.allgather_object(hpcddp.local_rank())
    if span == "node":
        groups = [[r for r, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
    else:
        groups = [[r for r, lr in enumerate(locals_) if lr == 0]]
    mine = next((g for g in groups if hpcddp.rank() in g), None)
    group = _Group(len(mine or groups[0]), mine is not None)
    comm = mpi_comm()
    if comm is not None and ("mpi4py" in paths or "hpcddp" in paths):
        MPI = import_mpi()
        color = groups.index(mine) if mine else MPI.UNDEFINED
        group.mpi = comm.Split(color, hpcddp.rank())
        if mine and "hpcddp" in paths:
            from ..comm.mpi import MPICommunicator

            group.hpcddp = MPICommunicator(group.mpi, hierarchical=False)
    if "torch" in paths:
        from ._torchdist import ensure_process_group

        dist = ensure_process_group()
        for ranks in groups:  # every rank takes part in making every group
            made = dist.new_group(ranks)
            if hpcddp.rank() in ranks:
                group.torch = made
    return group


def _buffer(count: int, device: torch.device) -> torch.Tensor:
    """Return zeros allocated alike for every path, so only the communication path differs.

    On the CPU they come from numpy, which asks Linux for transparent huge pages
    (torch's allocator does not): with THP in "madvise" mode raw MPI reduces a
    torch.zeros buffer up to ~20% slower at 64 MiB than a numpy one.
    """
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(count, dtype=np.float32))
    return torch.zeros(count, dtype=torch.float32, device=device)


def _synchronized(once: Callable[[], None], device: torch.device | None) -> Callable[[], None]:
    """Return ``once`` followed, on a GPU, by waiting for the device, as the torch path does.

    On nccl a collective returns once its kernel is queued: timed without this, the hpcddp
    path measured how fast kernels are queued, not reduced (issue 34, item 7).
    """
    if device is None or torch.device(device).type != "cuda":
        return once

    def once_and_wait() -> None:
        once()
        torch.cuda.synchronize(device)

    return once_and_wait


def _runner(
    path: str,
    count: int,
    shared: torch.Tensor,
    out_of_place: bool = False,
    group: _Group | None = None,
    op: str = "sum",
) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """Return (one allreduce, a view of its result as a tensor) for ``path``.

    In place by default; ``out_of_place`` reduces into a second buffer as MPI's
    send/receive form does (``hpcddp.allreduce``, ``Allreduce(sendbuf, recvbuf)``).
    ``op="average"`` is hpcddp's default: the raw paths then divide the sum
    themselves, as their users must (mpi4py with numpy, torch with ``div_``).

    Paths whose buffer lives on the CPU all reduce ``shared``: two buffers allocated
    one after the other were measured up to 1.5x apart at 4-16 MiB (the first one
    faster, whichever path used it), which would be billed to the path, not the buffer.
    """
    if group is not None and not group.active:
        return (lambda: None), (lambda: torch.full((1,), float(group.size)))
    size = group.size if group is not None else hpcddp.size()
    if path == "hpcddp" and group is not None and group.hpcddp is not None:
        from ..comm.base import parse_op

        sub, reduce_op = group.hpcddp, parse_op(op)
        return _synchronized(lambda: sub.allreduce_(shared, reduce_op), getattr(sub, "device", None)), (lambda: shared)
    if path == "hpcddp":
        tensor = shared if hpcddp.device().type == "cpu" else _buffer(count, hpcddp.device())
        if out_of_place:
            result = [tensor]

            def once():
                result[0] = hpcddp.allreduce(tensor, op=op)

            return _synchronized(once, tensor.device), (lambda: result[0])
        return _synchronized(lambda: hpcddp.allreduce_(tensor, op=op), tensor.device), (lambda: tensor)
    if path == "mpi4py":
        MPI = import_mpi()
        comm = group.mpi if group is not None and group.mpi is not None else mpi_comm()
        array = shared.numpy()
        if out_of_place:
            # A new result each time, as a function that returns one must allocate it.
            result = [array]

            def reduce_into_new():
                result[0] = np.empty_like(array)
                comm.Allreduce(array, result[0], op=MPI.SUM)
                if op == "average":
                    np.divide(result[0], size, out=result[0])

            return reduce_into_new, (lambda: torch.from_numpy(result[0]))

        def reduce_in_place():
            comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            if op == "average":
                np.divide(array, size, out=array)

        return reduce_in_place, (lambda: shared)
    from ._torchdist import ensure_process_group

    dist = ensure_process_group()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = shared if device.type == "cpu" else _buffer(count, device)

    torch_group = group.torch if group is not None else None

    def once():
        dist.all_reduce(tensor, group=torch_group)
        if op == "average":
            tensor.div_(size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return once, (lambda: tensor)


def path_label(path: str) -> str:
    """Return the column name of ``path``: torch's names its backend, ``torch (gloo)``."""
    if path != "torch":
        return path
    from ._torchdist import ensure_process_group

    return f"torch ({ensure_process_group().get_backend()})"


def _prepare(
    path: str, size: int, warmup: int, shared: torch.Tensor, out_of_place: bool, group: _Group, op: str = "sum"
) -> Callable[[], None]:
    """Return one allreduce of ``size`` bytes on ``path``, checked and warmed up."""
    count = size // 4
    once, view = _runner(path, count, shared, out_of_place, group if group.size != hpcddp.size() else None, op)
    # One reduction of ones proves the path sums before we time it; zeros keep
    # the repeated in-place sums finite afterwards.
    shared.fill_(1.0)
    view().fill_(1.0)
    once()
    got = view()[: min(count, 8)].cpu()
    expected = group.size if op == "sum" else 1
    if not torch.all(got == expected):
        raise RuntimeError(f"{path} allreduce of ones gave {got.tolist()}, expected {expected}")
    view().zero_()
    shared.zero_()
    for _ in range(warmup):
        once()
    return once


def _time_interleaved(runners: dict[str, Callable[[], None]], iters: int) -> dict[str, float]:
    """Return each path's median iteration time, the paths taking turns iteration by iteration.

    Taking turns puts the shared machine's load on every path alike; the order
    reverses every iteration (A B, B A, ...) because at 4-16 MiB whichever path ran
    first after the other was measured up to 1.5x faster. Back-to-back collectives
    keep the ranks in step without a barrier; the median shrugs off single hiccups.
    """
    samples: dict[str, list[float]] = {path: [] for path in runners}
    order = list(runners.items())
    for iteration in range(iters):
        for path, once in order if iteration % 2 == 0 else reversed(order):
            start = time.perf_counter()
            once()
            samples[path].append(time.perf_counter() - start)
    return {path: median(times) for path, times in samples.items()}


def sweep_allreduce(
    sizes: Sequence[int],
    iters: int = 20,
    warmup: int = 5,
    paths: Sequence[str] = PATHS,
    out_of_place: bool = False,
    span: str = "world",
    op: str = "sum",
) -> list[AllreduceResult]:
    """Time a float32 sum-allreduce at each size on each path; every rank must call this.

    At each size the paths take turns, one iteration each (see ``_time_interleaved``).

    Args:
        sizes: message sizes in bytes, multiples of 4.
        iters: timed iterations per size and path (median taken, then the slowest rank's).
        warmup: untimed iterations before them.
        paths: names from ``PATHS``; ones that cannot run here are skipped.
        out_of_place: reduce into a new buffer (``hpcddp.allreduce``, MPI's send/receive
            form); torch.distributed has no such form and reduces in place.
        span: one of ``SPANS``: "node" times each node's ranks among themselves (all
            nodes at once, shared memory), "between-nodes" one rank per node (the links
            alone); the bandwidths then count the ranks of one group.
        op: "sum", or "average" (hpcddp's default; the raw paths divide the sum themselves).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    chosen = available_paths(paths)
    group = _span_group(span, chosen)
    if span != "world" and hpcddp.backend() != "mpi" and "hpcddp" in chosen:
        chosen.remove("hpcddp")  # hpcddp's sub-groups need the mpi backend
    num_ranks = group.size
    results = []
    for size in sizes:
        if size <= 0 or size % 4:
            raise ValueError(f"sizes must be positive multiples of 4 bytes, got {size}")
        shared = _buffer(size // 4, torch.device("cpu"))
        runners = {path: _prepare(path, size, warmup, shared, out_of_place, group, op) for path in chosen}
        hpcddp.barrier()
        medians = _time_interleaved(runners, iters)
        for path in chosen:
            seconds = max(hpcddp.allgather_object(medians[path]))
            bandwidth = algbw(size, seconds)
            results.append(
                AllreduceResult(
                    path_label(path), size, size // 4, seconds * 1e6, bandwidth, busbw(bandwidth, num_ranks)
                )
            )
    _free(group)
    return results


def _free(group: _Group) -> None:
    if group.hpcddp is not None:
        group.hpcddp.close()
    if group.mpi is not None and group.mpi != import_mpi().COMM_NULL:
        group.mpi.Free()


def results_as_dicts(results: Sequence[AllreduceResult]) -> list[dict]:
    """Return the results as plain dicts for JSON."""
    return [asdict(r) for r in results]
