"""The stall inspector: one thread per rank that notices a stalled operation and reports it.

As Horovod's stall check, but without per-tensor negotiation. Each rank's thread wakes
every ``min(1 s, timeout / 4)`` and reads its own operation logs; nothing is sent while
no operation has waited ``timeout`` seconds. Then the waiting rank alarms rank 0, and
rank 0 asks every rank for its status over a communicator of its own (point-to-point,
so that ranks blocked in a collective still answer from this thread), judges
(``verdict``) and reports (``report``).

Policy, as the tools users know (Horovod warns at 60 s, torch.distributed ends a
collective after 30 min): a stall is a warning after ``timeout``, repeated every
``timeout``. The job ends when ranks are lost (no answer: dead, or their node is down
or cut off), when a rank left while others wait in an operation that needs it (with
that rank's exit code), when every rank is deadlocked (the same stuck state seen
twice), or once a stall has lasted ``abort_after``. A rank whose alarm rank 0 never
answers ends itself, so that no rank outlives a lost node.

A rank that leaves (the end of its script, ``sys.exit``, ``hpcddp.shutdown()``) tells
rank 0 first (rank 0 tells everyone), with how far it got on each communicator: a
clean end is never taken for a lost node, and a rank that leaves early is named at once.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

from ...comm import oplog
from .report import exit_reason, explain_stall
from .verdict import Exit, judge, stable, stuck_operations

__all__ = ["StallInspector"]

log = logging.getLogger("hpcddp")

_ALARM, _QUERY, _REPLY, _BYE = 71, 72, 73, 74
_STALE = object()


class StallInspector:
    """Watch this rank's operations; on rank 0, judge stalls for the whole job.

    Args:
        comm: an mpi4py communicator over every rank of the job, used only by the
            inspectors (it is duplicated; creating the inspector is collective).
        timeout: seconds an operation may wait before it counts as stalled.
        action: "abort" (end the job as above) or "warn" (only report).
        abort_after: seconds a stall may last before the job ends; 0 never.
    """

    #: seconds rank 0 waits for the ranks' answers; a rank that does not answer is lost
    ANSWER_WITHIN_S = 10.0

    def __init__(self, comm, timeout: float, action: str, abort_after: float = 0) -> None:
        from ...env.mpi_import import import_mpi

        self._MPI = import_mpi()
        self._comm = comm.Dup()
        # MPI may give a later inspector's communicator the context of a freed one, with
        # messages of the old one still queued (hpcddp.shutdown() then init()): every
        # message carries this inspector's token, and others' are dropped.
        self._token = self._comm.bcast(secrets.token_hex(8) if self._comm.Get_rank() == 0 else None, root=0)
        self.timeout = timeout
        self.action = action
        self.abort_after = abort_after
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self.hosts: list[str] = self._comm.allgather(socket.gethostname())
        self._interval = max(0.05, min(1.0, timeout / 4))
        self._stop = threading.Event()
        self._exits: dict[int, Exit] = {}
        self._alarmed: tuple | None = None
        self._alarmed_at = 0.0
        self._unanswered_since: float | None = None
        self._alarms_pending = False
        self._next_report = 0.0
        self._episode = 0
        self._sends: list = []
        self._left = False
        self._thread = threading.Thread(target=self._run, name="hpcddp-stall", daemon=True)
        self._thread.start()

    # -- leaving ----------------------------------------------------------------------
    def leave(self, how: str, code: int | None = None) -> None:
        """Stop the thread and tell the others this rank is gone (idempotent).

        Args:
            how: what the rank did, for reports ("exited", "called hpcddp.shutdown()").
            code: its exit code, when known.
        """
        if self._left:
            return
        self._left = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        started = oplog.started_counts()
        message = (how, code, started)
        for dest in range(1, self.size) if self.rank == 0 else [0]:
            self._send(message, dest, _BYE)
        # Small messages leave at once; a peer that is gone must not hold this rank at exit.
        deadline = time.monotonic() + 1.0
        while self._sends and time.monotonic() < deadline:
            self._sends = [request for request in self._sends if not request.Test()]
            time.sleep(0.001)
        if not self._sends:
            self._comm.Free()

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self._tick()
        except Exception:  # noqa: BLE001 - a broken inspector must not end training
            log.exception("hpcddp: the stall inspector failed and is off for this run")

    def _send(self, obj, dest: int, tag: int) -> None:
        self._sends = [request for request in self._sends if not request.Test()]
        self._sends.append(self._comm.isend((self._token, obj), dest=dest, tag=tag))

    def _recv(self, source: int, tag: int):
        """The message's content, or ``_STALE`` for one of an earlier inspector (see ``__init__``)."""
        token, obj = self._comm.recv(source=source, tag=tag)
        return obj if token == self._token else _STALE

    def _receive_byes(self) -> None:
        status = self._MPI.Status()
        while self._comm.Iprobe(tag=_BYE, status=status):
            message = self._recv(status.Get_source(), _BYE)
            if message is not _STALE:
                self._exits[status.Get_source()] = Exit(*message)

    def _stalled(self) -> bool:
        status = oplog.rank_status(self.rank)
        for comm in status["comms"].values():
            if any(age >= self.timeout and not desc.patient for desc, age in comm["running"]):
                return True
            if status["waits"] and any(age >= self.timeout for *_, age in comm["p2p"]):
                return True
        return False

    def _tick(self) -> None:
        self._receive_byes()
        if self.rank == 0:
            self._tick_rank0()
        else:
            self._tick_other()

    def _tick_other(self) -> None:
        while self._comm.Iprobe(source=0, tag=_QUERY):
            episode = self._recv(0, _QUERY)
            if episode is _STALE:
                continue
            self._unanswered_since = None
            if episode is not None:  # None only acknowledges an alarm
                self._send((episode, oplog.rank_status(self.rank)), 0, _REPLY)
        if 0 in self._exits:
            # Rank 0 left: judge alone whether an operation here needs it.
            mine = {self.rank: oplog.rank_status(self.rank)}
            if stuck_operations(mine, self._exits):
                reason, code = exit_reason(mine, self._exits)
                self._report(explain_stall(mine, self._exits, self.size, self.timeout, self.hosts), reason, code)
        if not self._stalled() or 0 in self._exits:
            self._unanswered_since = None
            return
        now = time.monotonic()
        if now - self._alarmed_at >= self.timeout:
            self._alarmed_at = now
            if self._unanswered_since is None:
                self._unanswered_since = now
            self._send(None, 0, _ALARM)
        if (
            self._unanswered_since is not None
            and now - self._unanswered_since > self.ANSWER_WITHIN_S + 2 * self._interval
        ):
            # Rank 0 answers every alarm within moments: it is gone, or cut off from here.
            self._report(
                f"[hpcddp stall inspector] rank {self.rank} on {self.hosts[self.rank]} waits in an operation and "
                f"rank 0 on {self.hosts[0]} did not answer its alarm: node {self.hosts[0]} is down or cut off from "
                "this node, or rank 0 died or hangs outside Python (holding the GIL)",
                "ranks were lost",
            )

    def _tick_rank0(self) -> None:
        status = self._MPI.Status()
        alarmed = False
        while self._comm.Iprobe(tag=_ALARM, status=status):
            if self._recv(status.Get_source(), _ALARM) is _STALE:
                continue
            # Answer at once, report or not: a rank whose alarm goes unanswered ends itself.
            self._send(None, status.Get_source(), _QUERY)
            alarmed = True
        # After a rank left, look every tick: a rank waiting for it waits forever.
        if not (alarmed or self._exits or self._stalled()):
            return
        first = self._gather()
        verdict = judge(first, self._exits)
        if verdict == "deadlock":
            # Certain only if nothing changed meanwhile: see hpcddp.fault.stall.verdict.
            if self._stop.wait(self._interval):
                return
            second = self._gather()
            if not stable(first, second):
                verdict = judge(second, self._exits)
                verdict = "slow" if verdict == "deadlock" else verdict
            first = second
        self._act(first, verdict)

    def _gather(self) -> dict:
        """Every rank's status (None for a rank that does not answer in time), exited ranks left out."""
        self._episode += 1
        pending = {r for r in range(1, self.size) if r not in self._exits}
        for r in pending:
            self._send(self._episode, r, _QUERY)
        statuses: dict = {r: None for r in pending}
        statuses[0] = oplog.rank_status(0)
        deadline = time.monotonic() + max(self.ANSWER_WITHIN_S, 2 * self._interval)
        status = self._MPI.Status()
        while pending and time.monotonic() < deadline and not self._stop.is_set():
            if self._comm.Iprobe(tag=_REPLY, status=status):
                message = self._recv(status.Get_source(), _REPLY)
                episode, answer = (None, None) if message is _STALE else message
                if episode == self._episode:
                    statuses[answer["rank"]] = answer
                    pending.discard(answer["rank"])
                continue
            self._receive_byes()
            for r in pending & self._exits.keys():
                del statuses[r]
            pending -= self._exits.keys()
            time.sleep(0.01)
        return statuses

    # -- verdicts ---------------------------------------------------------------------
    def _act(self, statuses: dict, verdict: str) -> None:
        if self._stop.is_set():
            return  # this rank is leaving: what it saw may be the others leaving too
        report = explain_stall(statuses, self._exits, self.size, self.timeout, self.hosts)
        reason, code = None, 1
        if verdict == "lost":
            reason = "ranks were lost"
        elif verdict == "exited":
            reason, code = exit_reason(statuses, self._exits)
        elif verdict == "deadlock":
            reason = "every rank waits in an operation that can never complete (seen twice)"
        else:
            longest = max(
                (
                    a
                    for s in statuses.values()
                    if s
                    for c in s["comms"].values()
                    for d, a in c["running"]
                    if not d.patient
                ),
                default=0.0,
            )
            if longest < self.timeout:
                return  # a rank left or alarmed, and nothing waits any more
            if self.abort_after and longest >= self.abort_after:
                reason = f"the stall has lasted {longest:.0f} s (stall_abort_after={self.abort_after:g} s)"
        self._report(report, reason, code)

    def _report(self, report: str, reason: str | None, code: int = 1) -> None:
        """Abort for ``reason`` (with stall_action="abort"), else warn at most once per ``timeout``."""
        if reason is not None and self.action == "abort":
            from ..abort import abort_job

            abort_job(f"{report}\n[hpcddp stall inspector] aborting the job: {reason}", use_mpi=True, code=code)
        if time.monotonic() < self._next_report:
            return
        self._next_report = time.monotonic() + self.timeout
        if reason is not None:
            outcome = f"{reason}; stall_action={self.action!r}: the job goes on"
        elif self.action == "abort" and self.abort_after:
            outcome = f"the job ends if it lasts {self.abort_after:g} s (stall_abort_after, HPCDDP_STALL_ABORT_AFTER)"
        else:
            outcome = (
                f"the job never ends for it (stall_action={self.action!r}, stall_abort_after={self.abort_after:g})"
            )
        log.warning("%s\n[hpcddp stall inspector] still waiting; %s", report, outcome)
