"""The MPI communicator and everything only it uses; its public entry is ``MPICommunicator``.

- ``communicator``: ``MPICommunicator``, which plans every collective (its MPI calls and
  staging) and hands it to its engine.
- ``engine``: the rules every road to MPI follows (its docstring), and the ``Engine`` that
  enforces them on one communicator: one runner thread, one order, completion on the runner.
- ``agreeing``: the agreement every collective starts with (one small ``MPI_Iallreduce`` of
  what ``hpcddp.comm.agreement`` describes), and the timeout measured there.
- ``waits``: how a rank waits for an MPI request (spin, yield, sleep) and gives up.
- ``buffers``: torch tensors as MPI buffers (staging through host memory, pieces MPI can count).
- ``planned_allreduce``: in-place allreduces of contiguous CPU tensors, planned once per signature.
- ``hierarchy``: the two-level allreduce (inside nodes, then between them).
- ``gradient_channel``: an optimizer's buckets on a communicator of their own, agreed once per step.
- ``p2p``: sends and receives, outside the collectives' queue.
- ``monitored_barrier``: gloo's ``monitoredBarrier`` over the communicator's messages.
- ``shared_window``: bytes one rank fills, held once per node in MPI shared memory.

``from hpcddp.comm.mpi import MPICommunicator`` imports ``communicator`` on first use, so that
importing one module of the package does not import them all: ``hpcddp.runtime.bootstrap``
imports ``waits`` at once and the communicator only when the job runs on MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .communicator import MPICommunicator

__all__ = ["MPICommunicator"]


def __getattr__(name: str) -> Any:
    if name == "MPICommunicator":
        from .communicator import MPICommunicator

        return MPICommunicator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
