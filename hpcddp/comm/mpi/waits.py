"""How a communicator waits for MPI requests (rule 7 of ``hpcddp.comm.mpi.engine``) and gives up at its timeout (rule 9).

MPI cannot cancel a collective request, and freeing a pending one is erroneous, so a
request given up at a timeout (``abandon``) is kept, with its buffers, for the life of
the process; MPI_Finalize tolerates it.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

__all__ = ["abandon", "describe_members", "one_core", "share_cores", "timed_out", "wait_for_request"]

_SPIN_S = 5e-3
# Ranks that share cores: a yield hands the core to another rank for a whole time slice
# (measured: 1.5-3.5 ms late), where a short sleep wakes on time.
_SHARED_CORES_SPIN_S = 50e-6
_LONGEST_SLEEP_S = 200e-6
# Tested without a yield first: a peer that is running reaches a small collective within
# MPI's hop latency (a few us), and a yield where other processes are runnable (a busy
# machine) hands the core away for a whole time slice: the small allreduce's median went
# from ~20 us to 1-12 ms with the cores busy, the peer spinning in the data's Allreduce.
_HOT_SPIN_S = 100e-6
# A yield that came back this late handed the core to another process for a time slice.
_LOST_SLICE_S = 500e-6
_spin_s = _SPIN_S
_hot_spin_s = _HOT_SPIN_S
_ABANDONED: list = []


class Receives(Protocol):
    """The point-to-point layer as a wait sees it (``hpcddp.comm.mpi.p2p.PointToPoint``)."""

    def progress(self) -> None: ...

    def next_progress_in(self) -> float | None: ...


def share_cores(oversubscribed: bool) -> None:
    """Set how long a wait tests with yields before it sleeps: 5 ms when each rank has its cores, 50 us when not.

    Args:
        oversubscribed: this node's ranks outnumber its cores (``hpcddp.init()`` decides).
    """
    global _spin_s, _hot_spin_s
    _spin_s = _SHARED_CORES_SPIN_S if oversubscribed else _SPIN_S
    # Where ranks share cores the peer may need this very core: yield from the first test.
    _hot_spin_s = 0.0 if oversubscribed else _HOT_SPIN_S


def wait_for_request(request, messages: Receives | None = None, deadline: float | None = None) -> bool:
    """Complete an MPI request as rule 7 says: test it for 100 us, then yielding the core up to 5 ms; then sleep.

    Returns False, the request still pending, when ``deadline`` passed first.

    Args:
        request: the mpi4py request.
        messages: point-to-point receives in flight (rule 6), moved on between tests.
        deadline: a ``time.monotonic()`` to give up at; None waits as long as it takes.
    """
    if request.Test():
        return True
    # A collective progresses only inside a test on every rank it passes through: a rank
    # asleep when a hop arrives delays every later hop by its sleep, so ranks that arrive
    # within the spin see MPI's own latency. MPI_Wait would spin as well but never yield
    # the core and never move the receives in flight on; a wait longer than the spin is a
    # straggler's, where a sleep costs little and gives the core to training threads.
    now = time.perf_counter()
    hot_until, spin_until = now + _hot_spin_s, now + _spin_s
    pause = 10e-6
    while not request.Test():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if messages is not None:
            messages.progress()
        now = time.perf_counter()
        if now < hot_until:
            continue
        if now < spin_until:
            os.sched_yield()
            if time.perf_counter() - now > _LOST_SLICE_S:
                spin_until = now  # other processes want the core: sleep, which wakes on time, from here on
        else:
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


def one_core() -> bool:
    """True when this process may run on one core only (``taskset``, ``--bind-to core``, ``srun --cpu-bind``).

    A communication thread there can only take the core from the training thread: busy in
    MPI's progress loop while backward runs, it slowed every hook about threefold, and no
    sum finished before backward did. Work that could overlap backward then waits until
    the training thread waits for it, and runs in that thread.
    """
    global _one_core
    if _one_core is None:
        _one_core = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1
    return _one_core


_one_core: bool | None = None
