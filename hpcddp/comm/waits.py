"""How a communicator waits for MPI requests (rule 7 of ``hpcddp.comm.engine``) and gives up at its timeout (rule 9).

MPI cannot cancel a collective request, and freeing a pending one is erroneous, so a
request given up at a timeout (``abandon``) is kept, with its buffers, for the life of
the process; MPI_Finalize tolerates it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["abandon", "describe_members", "timed_out", "wait_for_request"]

_SPIN_S = 50e-6
_LONGEST_SLEEP_S = 250e-6
_ABANDONED: list = []


def wait_for_request(request, progress: Callable[[], None] | None = None, deadline: float | None = None) -> bool:
    """Complete an MPI request as rule 7 says: spin 50 us, then sleep between tests.

    Returns False, the request still pending, when ``deadline`` passed first.

    Args:
        request: the mpi4py request.
        progress: called between sleeps (point-to-point receives in flight, rule 6).
        deadline: a ``time.monotonic()`` to give up at; None waits as long as it takes.
    """
    if request.Test():
        return True
    spin_until = time.perf_counter() + _SPIN_S
    while time.perf_counter() < spin_until:
        if request.Test():
            return True
    pause = 10e-6
    while not request.Test():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if progress is not None:
            progress()
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_SLEEP_S)
    return True


def abandon(request, *buffers) -> None:
    """Keep a request given up at a timeout, and the buffers it may still read or write, until the process ends."""
    _ABANDONED.append((request, buffers))


def timed_out(op: str, group: str, timeout: float) -> RuntimeError:
    """The error of ``op`` when the other ranks of ``group`` did not join it within ``timeout`` seconds."""
    return RuntimeError(
        f"{op} on {group}: Timed out after {timeout:g} s waiting for the other ranks to call it (the group's "
        "timeout); the group cannot be used any more, its ranks are out of step: make every rank of the group "
        "call the same collectives in the same order, or give the group a longer timeout="
    )


def describe_members(members) -> str:
    """``ranks 0-7`` for a range, else the list (cut short past 16 ranks), for messages."""
    members = list(members)
    if len(members) > 1 and members == list(range(members[0], members[-1] + 1)):
        return f"ranks {members[0]}-{members[-1]}"
    return f"ranks {members}" if len(members) <= 16 else f"ranks {members[:8]}... ({len(members)} ranks)"
