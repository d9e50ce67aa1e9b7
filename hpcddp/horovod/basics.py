"""Horovod's process layout, build queries, reduction ops and timeline switches."""

from __future__ import annotations

import torch

from .. import bootstrap
from ..comm.base import ReduceOp

__all__ = [
    "Adasum", "Average", "Max", "Min", "Sum", "cross_rank", "cross_size", "cuda_built", "global_process_set",
    "gloo_built", "gloo_enabled", "init", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline",
]  # fmt: skip

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
#: accepted as a name so scripts import; using it raises NotImplementedError
Adasum = "adasum"

#: Horovod's default process set: all ranks (the only one hpcddp supports)
global_process_set = "global"

# (cross_rank, cross_size), computed collectively by init() (or the first call).
_cross: tuple[int, int] | None = None


def check_process_set(process_set) -> None:
    """Refuse any process set but the global one."""
    if process_set is not global_process_set and process_set is not None:
        raise NotImplementedError(
            f"hpcddp.horovod supports only the global process set, got process_set={process_set!r}: drop it"
        )


def init(comm=None, process_sets=None) -> None:
    """Start hpcddp (``hpcddp.init()``); collective. ``comm`` and ``process_sets`` must stay None.

    Args:
        comm: Horovod's sub-communicator option; only all ranks are supported.
        process_sets: Horovod's process sets; not supported.
    """
    if comm is not None or process_sets not in (None, "dynamic"):
        raise NotImplementedError(
            f"hpcddp.horovod.init supports only the global communicator, got comm={comm!r}, "
            f"process_sets={process_sets!r}: drop both"
        )
    bootstrap.init()
    _compute_cross()


def _compute_cross() -> tuple[int, int]:
    # Horovod's "cross" group: the ranks with this local rank, one per node that has it.
    global _cross
    from ..collectives import allgather_object

    local_ranks = allgather_object(bootstrap.local_rank())
    mine = [r for r, local in enumerate(local_ranks) if local == bootstrap.local_rank()]
    _cross = (mine.index(bootstrap.rank()), len(mine))
    return _cross


def cross_rank() -> int:
    """Return this rank's index among the ranks with its local rank (its node, on even nodes).

    Known after ``hvd.init()``; after a plain ``hpcddp.init()`` the first call is a
    collective, so make it on every rank.
    """
    return (_cross or _compute_cross())[0]


def cross_size() -> int:
    """Return how many ranks share this rank's local rank (the node count, on even nodes)."""
    return (_cross or _compute_cross())[1]


def shutdown() -> None:
    """Leave the job (``hpcddp.shutdown()``)."""
    global _cross
    _cross = None
    bootstrap.shutdown()


is_initialized = bootstrap.is_initialized
size = bootstrap.size
rank = bootstrap.rank
local_size = bootstrap.local_size
local_rank = bootstrap.local_rank


def mpi_threads_supported() -> bool:
    """Return True when MPI runs with MPI_THREAD_MULTIPLE (hpcddp's communication thread needs it)."""
    from .._mpi import import_mpi

    MPI = import_mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    """Return True when mpi4py can be imported."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """Return True when collectives go through MPI."""
    return bootstrap.backend() == "mpi"


def gloo_built() -> bool:
    """Return True when torch has gloo."""
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def gloo_enabled() -> bool:
    """Return True when collectives go through gloo."""
    return bootstrap.backend() == "gloo"


def nccl_built() -> int:
    """Return torch's NCCL version code (e.g. 22005 for 2.20.5), or 0 without NCCL, as Horovod does."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, ValueError):
        return 0
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """Return True when torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Return True when torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path, mark_cycles=False) -> None:
    """Start recording hpcddp's timeline to ``file_path`` (see ``hpcddp.timeline``); collective."""
    from ..timeline import start

    start(file_path)


def stop_timeline() -> None:
    """Stop recording and write the timeline file (rank 0); collective."""
    from ..timeline import stop

    stop()
