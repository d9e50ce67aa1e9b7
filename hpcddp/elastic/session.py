"""The rank's side of an elastic job: its link to the driver and the commits kept on its node.

``worker_session()`` returns None in a job that no elastic driver started (plain mpirun,
srun, torchrun): commits then stay in memory and a failure ends the job, as with
Horovod's elastic API outside ``horovodrun``. Under ``hpcddp run --min-np`` it connects
once per process, after ``hpcddp.init()``.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from ..env.elastic import read_elastic_session
from ..runtime import state as runtime
from .commits import CommitStore
from .worker import DriverLink

__all__ = ["RESTART_MESSAGE", "WorkerSession", "worker_session"]

#: what a rank that leaves to be started again says
RESTART_MESSAGE = "leaves the elastic job to be started again by the driver"

_session: WorkerSession | None = None


class WorkerSession:
    """One rank's part in an elastic run (see ``worker_session``)."""

    def __init__(self) -> None:
        env = read_elastic_session(os.environ)
        assert env is not None
        host = socket.gethostname()
        self.launch = env.launch
        self.rank, self.size, self.local_rank = runtime.rank(), runtime.size(), runtime.local_rank()
        self.store = CommitStore(env.run, env.commit_dir, host)
        self.link = DriverLink(env, self.rank, self.size, host)
        self._finished = False
        self._resumed = False
        previous_hook = sys.excepthook

        def excepthook(exc_type, exc, tb):
            # Before hpcddp's hook aborts the job: an error that a restart would only repeat.
            summary = "".join(traceback.format_exception_only(exc_type, exc)).strip()
            self.finish("error", summary)
            previous_hook(exc_type, exc, tb)

        sys.excepthook = excepthook
        atexit.register(self.finish, "done")

    def keep(self, serial: int, snapshot: dict[str, Any]) -> None:
        """Keep commit ``serial`` on this node (its local rank 0 writes it) and tell the driver."""
        if self.local_rank == 0:
            self.store.write(serial, snapshot)
        if self.rank == 0:
            self.link.report_commit(serial)

    def newest_commit(
        self, allgather: Callable[[Any], list[Any]], broadcast: Callable[[Any, int], Any]
    ) -> tuple[int, dict[str, Any]] | None:
        """Return the newest commit any node holds, on every rank (collective), or None; once per process.

        Args:
            allgather: gathers one object from every rank (``hvd.allgather_object``).
            broadcast: ``broadcast(obj, root)`` returns root's object on every rank.
        """
        if self.launch == 0:
            return None  # a first start: no commit of this run exists yet
        if self._resumed:
            # A second hvd.elastic.run function (or a second call) in this process goes on from the
            # state as the first left it: the node's commit may be older (steps after the last commit).
            return None
        self._resumed = True
        serials = allgather(self.store.latest_serial() if self.local_rank == 0 else -1)
        newest = max(serials)
        if newest < 0:
            return None
        owner = serials.index(newest)
        snapshot = self.store.read()[1] if self.rank == owner else None
        return newest, broadcast(snapshot, owner)

    def leave_for_restart(self, reason: str) -> None:
        """Tell the driver, leave the job (``hpcddp.shutdown()``) and end the process; the driver starts it again."""
        self.finish("restart", reason)
        runtime.shutdown()
        sys.stderr.write(f"[hpcddp rank {self.rank}] {RESTART_MESSAGE} ({reason})\n")
        sys.stderr.flush()
        raise SystemExit(0)  # a clean end: the launcher must not report this rank as failed

    def finish(self, kind: str, text: str = "") -> None:
        """Send this rank's last word once (``done`` at a normal exit)."""
        if self._finished:
            return
        self._finished = True
        self.link.finish(kind, text)
        if kind != "restart" and self.local_rank == 0:
            self.store.remove()  # the run is over: no start will look for it


def worker_session() -> WorkerSession | None:
    """Return this rank's elastic session (made at the first call), or None outside an elastic job."""
    global _session
    if _session is None and read_elastic_session(os.environ) is not None:
        _session = WorkerSession()
    return _session
