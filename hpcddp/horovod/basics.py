"""Horovod's process layout, build queries, reduction ops and timeline switches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.base import ReduceOp
from ..runtime import lifecycle, state

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "Product", "Sum", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init", "is_initialized", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline",
]  # fmt: skip

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
#: Horovod's Adasum reduction (see hpcddp.horovod.adasum); not a ReduceOp of the communicators
Adasum = "adasum"


class HorovodInternalError(RuntimeError):
    """Horovod's error for a failed collective; hpcddp raises CollectiveMismatchError (also a RuntimeError)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``state.commit()`` on every rank when hosts were added or removed (Horovod's elastic API).

    Args:
        skip_sync: True when hosts were only removed: the ranks left hold the same state.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the elastic job changed")
        self.skip_sync = skip_sync


# (cross_rank, cross_size), computed collectively by init() (or the first call).
_cross: tuple[int, int] | None = None
# Run at the end of every init(); registered by the modules whose objects outlive a shutdown().
_init_callbacks: list[Callable[[], object]] = []


def at_init(callback: Callable[[], object]) -> None:
    """Run ``callback`` at the end of every ``init()``, on every rank (it may make collectives).

    Args:
        callback: e.g. moving objects made before ``shutdown()`` to the new communicator.
    """
    _init_callbacks.append(callback)


def init(comm=None, process_sets=None) -> None:
    """Start hpcddp (``hpcddp.init()``) and register ``process_sets``; collective. Again after ``shutdown()``.

    After ``shutdown()``, the DistributedOptimizers made before (global process set)
    reduce over the new communicator from their next backward pass, as Horovod's do.

    Args:
        comm: Horovod's sub-communicator option (a list of ranks or an mpi4py
            communicator); only all ranks are supported.
        process_sets: ProcessSets (or rank lists) to register at once, or "dynamic".
    """
    if comm is not None:
        raise NotImplementedError(
            f"hpcddp.horovod.init supports only the global communicator, got comm={comm!r}: "
            "drop it and use process_sets= (hvd.add_process_set) for subsets of ranks"
        )
    lifecycle.init()
    _compute_cross()
    if process_sets not in (None, "dynamic"):
        from .process_sets import add_process_set

        for process_set in process_sets:
            add_process_set(process_set)
    for callback in _init_callbacks:
        callback()


def _compute_cross() -> tuple[int, int]:
    # Horovod's "cross" group: the ranks with this local rank, one per node that has it.
    global _cross
    from ..collectives.tensors import allgather_object

    local_ranks = allgather_object(state.local_rank())
    mine = [r for r, local in enumerate(local_ranks) if local == state.local_rank()]
    _cross = (mine.index(state.rank()), len(mine))
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
    """Leave the job (``hpcddp.shutdown()``); ``init()`` may be called again afterwards."""
    global _cross
    from .process_sets import forget_process_sets

    _cross = None
    if state.is_initialized():
        forget_process_sets()
    state.shutdown()


is_initialized = state.is_initialized
size = state.size
rank = state.rank
local_size = state.local_size
local_rank = state.local_rank


def mpi_threads_supported() -> bool:
    """Return True when MPI runs with MPI_THREAD_MULTIPLE (hpcddp's communication thread needs it)."""
    from ..env.mpi_import import import_mpi

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
    return state.backend() == "mpi"


def gloo_built() -> bool:
    """Return True when torch has gloo."""
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def gloo_enabled() -> bool:
    """Return True when collectives go through gloo."""
    return state.backend() == "gloo"


def nccl_built() -> int:
    """Return torch's NCCL version code (e.g. 22005 for 2.20.5), or 0 without NCCL, as Horovod does."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, ValueError):
        return 0
    return major * 10000 + minor * 100 + patch


def ccl_built() -> bool:
    """Return False: hpcddp has no oneCCL backend."""
    return False


def ddl_built() -> bool:
    """Return False: hpcddp has no IBM DDL backend."""
    return False


def cuda_built() -> bool:
    """Return True when torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Return True when torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path, mark_cycles=False) -> None:
    """Start recording hpcddp's timeline to ``file_path`` (see ``hpcddp.observe.timeline``); collective.

    ``mark_cycles`` is accepted for Horovod's signature (hpcddp has no cycles).
    """
    from ..observe.timeline import start

    start(file_path)


def stop_timeline() -> None:
    """Stop recording and write the timeline file (rank 0); collective."""
    from ..observe.timeline import stop

    stop()
