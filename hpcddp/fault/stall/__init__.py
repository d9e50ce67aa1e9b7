"""The stall inspector: name the ranks that keep the others waiting, and end a job that cannot go on.

- ``hpcddp.comm.oplog`` (not here: the communicators write it): what each communicator on
  this rank is doing;
- ``verdict``: lost, exited, deadlocked or slow, judged from every rank's status;
- ``report``: the message naming the operation, the missing ranks and the likely cause;
- ``liveness``: whether a rank that does not answer still uses the CPU (read on its node);
- ``inspector``: the thread on each rank, and rank 0's questions to the others.

One inspector runs per process, over every communicator hpcddp made (``start``).
"""

from __future__ import annotations

from .inspector import StallInspector
from .report import explain_stall

__all__ = [
    "StallInspector",
    "current",
    "explain_stall",
    "leave",
    "start",
]

_inspector: StallInspector | None = None


def start(comm, timeout: float, action: str, abort_after: float) -> StallInspector:
    """Start this process's inspector over ``comm`` (every rank of the job; collective)."""
    global _inspector
    _inspector = StallInspector(comm, timeout, action, abort_after)
    return _inspector


def current() -> StallInspector | None:
    """The running inspector, or None (stall_timeout=0, a world of one, no MPI)."""
    return _inspector


def leave(how: str, code: int | None = None) -> None:
    """Stop the inspector and tell the other ranks that this one is gone (see ``StallInspector.leave``)."""
    global _inspector
    if _inspector is not None:
        _inspector.leave(how, code)
        _inspector = None
