"""Whether a rank that does not answer is alive and computing, read from the kernel, not from its Python.

A rank whose Python holds the GIL in one long C call (a ``list.sort()`` of 40M floats, a
big regex, a long pickle) cannot answer the inspector: none of its threads runs Python
until the call returns. The kernel still shows what it does: its CPU time advances. A
stopped (SIGSTOP), dead or zombie process, or one blocked without using the CPU, is not
busy. Only a process on the same node can read another's ``/proc/<pid>/stat``, so a
node is a kernel, a process-id namespace and a network namespace, not a host name
(containers share one). The network namespace counts because a process that can be read
may still be cut off: network namespaces on one kernel (containers, virtual nodes) have
links of their own, and a rank behind a cut link is alive, computing, and lost to the job.
"""

from __future__ import annotations

import os
import time

__all__ = ["BUSY_CORES", "WINDOW_S", "busy_processes", "this_process"]

#: CPU cores a silent process must use to count as busy: a stopped or hung one uses none, and
#: a computing one gets far more even on a node loaded 20 processes to a core
BUSY_CORES = 0.02
#: seconds between the two readings of a silent process's CPU time (a few of the kernel's 10 ms ticks)
WINDOW_S = 1.0


def _stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first)."""
    with open(f"/proc/{pid}/stat", "rb") as file:
        return file.read().rsplit(b")", 1)[1].split()


def this_process() -> tuple[str, int, int] | None:
    """Return this process's (node, pid, start time), or None where there is no ``/proc`` to read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            node = f"{file.read().strip()} {os.readlink('/proc/self/ns/pid')} {os.readlink('/proc/self/ns/net')}"
        return node, os.getpid(), int(_stat(os.getpid())[19])
    except (OSError, IndexError, ValueError):
        return None


def _cpu_seconds(pid: int, start: int) -> float | None:
    """CPU time of every thread of the process, or None if it is gone, stopped or another one now."""
    try:
        fields = _stat(pid)
    except OSError:
        return None
    if fields[0] in (b"T", b"t", b"Z", b"X", b"x") or int(fields[19]) != start:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_processes(processes: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Return those of ``processes`` (pid, start time; on this node) that use the CPU for ``WINDOW_S``.

    Args:
        processes: (pid, start time) of each process, as ``this_process`` gave them.
    """
    if not processes:
        return set()
    before = {process: _cpu_seconds(*process) for process in processes}
    started = time.monotonic()
    time.sleep(WINDOW_S)
    elapsed = time.monotonic() - started
    busy = set()
    for process, cpu in before.items():
        now = _cpu_seconds(*process)
        if cpu is not None and now is not None and now - cpu > BUSY_CORES * elapsed:
            busy.add(process)
    return busy
