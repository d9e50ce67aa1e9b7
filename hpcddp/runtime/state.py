"""The running job as this process sees it: its ranks, device and communicator, and how it ends.

``hpcddp.init()`` (``lifecycle``) fills it once; everything else reads it through the
functions here. Features that must end collectively (a timeline, torch.distributed
groups) register with ``at_shutdown``, and what a rank must save when it ends the job
alone (a timeline's events) with ``at_abort``; this module imports none of them.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm.base import Communicator
from ..env import ClusterEnvironment, RankLayout
from .config import InitConfig

__all__ = [
    "Runtime",
    "at_abort",
    "at_shutdown",
    "backend",
    "communicator",
    "current_runtime",
    "device",
    "environment_name",
    "install",
    "is_initialized",
    "launcher_comm",
    "local_rank",
    "local_size",
    "new_mpi_communicator",
    "node_rank",
    "num_nodes",
    "rank",
    "run_abort_callbacks",
    "shutdown",
    "shutdown_at_exit",
    "size",
]


@dataclass
class Runtime:
    """What ``init()`` found and made: one per process, from ``init()`` to ``shutdown()``."""

    config: InitConfig
    environment: ClusterEnvironment
    layout: RankLayout
    device: torch.device
    comm: Communicator
    num_threads: int


_runtime: Runtime | None = None
#: what shutdown() runs first, newest first: collective endings such as writing a timeline
_shutdown_callbacks: list[Callable[[], object]] = []
_shutdown_registered = False
#: what a rank that ends the job (``fault.abort.abort_job``) runs first, oldest first
_abort_callbacks: list[Callable[[], object]] = []


def install(runtime: Runtime) -> None:
    """Make ``runtime`` the running job (``hpcddp.init()`` calls this once it is complete)."""
    global _runtime
    _runtime = runtime


def shutdown_at_exit() -> None:
    """Make sure ``shutdown()`` runs at interpreter exit (once, however often asked).

    For what must end collectively: torch.distributed groups, timelines.
    """
    global _shutdown_registered
    if not _shutdown_registered:
        atexit.register(_shutdown_at_exit)
        _shutdown_registered = True


def _shutdown_at_exit() -> None:
    if _runtime is not None:
        # The process ends: a default group the script made and left goes too, collectively,
        # rather than in torch's teardown (where gloo's threads can abort the process).
        _runtime.comm.process_ending = True
    shutdown()


def at_shutdown(callback: Callable[[], object], *, at_exit: bool = True) -> None:
    """Run ``callback`` in ``shutdown()``, before the communicator closes; once, newest first.

    Args:
        callback: called with no arguments on every rank; may use collectives.
        at_exit: also make ``shutdown()`` run at interpreter exit when the script does
            not call it (False for endings that have their own at-exit path).
    """
    if callback not in _shutdown_callbacks:
        _shutdown_callbacks.append(callback)
    if at_exit:
        shutdown_at_exit()


def at_abort(callback: Callable[[], object]) -> None:
    """Run ``callback`` when this rank ends the job through an abort (an uncaught exception); once.

    Args:
        callback: called with no arguments on the aborting rank only: it must not use
            collectives, and should be quick (the abort waits for it).
    """
    if callback not in _abort_callbacks:
        _abort_callbacks.append(callback)


def run_abort_callbacks() -> list[str]:
    """Run what was registered with ``at_abort``; return one line for each that failed."""
    failures = []
    while _abort_callbacks:
        callback = _abort_callbacks.pop(0)
        try:
            callback()
        except Exception as err:  # noqa: BLE001 - the abort goes on whatever a callback does
            failures.append(f"{getattr(callback, '__qualname__', callback)}: {type(err).__name__}: {err}")
    return failures


def _require() -> Runtime:
    if _runtime is None:
        raise RuntimeError("hpcddp is not initialised: call hpcddp.init() first")
    return _runtime


def current_runtime() -> Runtime | None:
    """Return the running job's Runtime, or None before ``hpcddp.init()``."""
    return _runtime


def is_initialized() -> bool:
    """Return True between ``init()`` and ``shutdown()``."""
    return _runtime is not None


def rank() -> int:
    """Return this process's rank in the job (0 .. size()-1)."""
    return _require().layout.rank


def size() -> int:
    """Return the number of ranks in the job."""
    return _require().layout.world_size


def local_rank() -> int:
    """Return this process's rank among the ranks on its node."""
    return _require().layout.local_rank


def local_size() -> int:
    """Return the number of ranks on this node."""
    return _require().layout.local_size


def node_rank() -> int:
    """Return the index of this node in the job (0 .. num_nodes()-1)."""
    return _require().layout.node_rank


def num_nodes() -> int:
    """Return the number of nodes in the job."""
    return _require().layout.num_nodes


def device() -> torch.device:
    """Return the device this rank computes on (``cuda:N`` or ``cpu``)."""
    return _require().device


def backend() -> str:
    """Return the communication backend in use: "mpi", "nccl", "gloo" or "local"."""
    return _require().comm.name


def launcher_comm():
    """Return the launcher's MPI communicator over all ranks, or None (srun without MPI, torchrun)."""
    return _require().environment.mpi_comm


def environment_name() -> str:
    """Return the name of the launch environment init() detected (e.g. "mpirun", "slurm")."""
    return _require().environment.name


def new_mpi_communicator(mpi_comm):
    """Return an ``MPICommunicator`` over ``mpi_comm`` (collective over it); the stall inspector sees it.

    Args:
        mpi_comm: an mpi4py communicator; it is duplicated.
    """
    from ..comm.mpi import MPICommunicator

    _require()
    return MPICommunicator(mpi_comm)


def communicator() -> Communicator:
    """Return the active Communicator (for wrappers and tests)."""
    return _require().comm


def shutdown() -> None:
    """Leave the job: run what was registered with ``at_shutdown`` (writing a timeline,
    telling the stall inspector), stop the communication thread and destroy the process
    group. Collective when a timeline is recorded.

    MPI itself stays initialised (it cannot be re-initialised in one process);
    mpi4py finalises it at exit.
    """
    global _runtime
    if _runtime is not None:
        while _shutdown_callbacks:
            _shutdown_callbacks.pop()()
        _runtime.comm.close()
        _runtime = None
