"""The stall inspector: one thread per rank that notices a stalled operation and reports it.

As Horovod's stall check, but without per-tensor negotiation. Each rank's thread wakes
every ``min(1 s, timeout / 4)`` and reads its own operation logs; nothing is sent while
no operation has waited ``timeout`` seconds. Then the waiting rank alarms rank 0, and
rank 0 asks every rank for its status over a communicator of its own (point-to-point,
so that ranks blocked in a collective still answer from this thread; each reply is of
constant size, ``reply_status``), judges (``verdict``, visiting each rank once) and
reports (``report``). A rank that does not answer is asked about
once more, of its kernel: a rank on its node reads whether its process uses the CPU
(``liveness``), since a rank that holds the GIL in one long C call cannot answer from
Python, yet is only slow.

Policy, as the tools users know (Horovod warns at 60 s, torch.distributed ends a
collective after 30 min): a stall is a warning after ``timeout``, repeated every
``timeout``. The job ends when ranks are lost (no answer and no CPU time used: dead,
stopped, or their node is down or cut off), when a rank left while others wait in an
operation that needs it (with that rank's exit code), when every rank is deadlocked
(the same stuck state seen twice), or once a stall has lasted ``abort_after``. A rank
whose alarm rank 0 never answers ends itself unless rank 0 is busy, so that no rank
outlives a lost node. Silence counts as loss only once it has lasted ``lost_after``
(``timeout``, at least ``ANSWER_WITHIN_S``): a node whose links stall for a while (TCP
retransmissions on a loaded or congested network) has answered late, not died, and the
tools users know give a silent peer minutes (NCCL's watchdog 10, gloo 30), not seconds.

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
from . import liveness
from .report import exit_reason, explain_stall, what_it_waits_in
from .verdict import Exit, judge, longest_wait, stable, stuck_operations

__all__ = ["StallInspector", "reply_status"]

log = logging.getLogger("hpcddp")

_ALARM, _QUERY, _REPLY, _BYE, _CHECK, _CHECKED = 71, 72, 73, 74, 75, 76
_STALE = object()


#: finished operations per communicator a rank's reply names (rank 0 receives p replies every tick)
REPLY_HISTORY = 8


def reply_status(rank: int) -> dict:
    """This rank's ``oplog.rank_status`` as sent to rank 0: of constant size, whatever the number of ranks.

    A communicator's members go only with its first member's reply (rank 0 is the first
    of the job's); the others send its key and size (``verdict`` counts, it does not walk
    member lists). Of its finished operations, the last ``REPLY_HISTORY``: a report needs
    a rank's last one, and the one others wait in if this rank is past it (a rank gets
    past an operation the others still wait in only through operations that complete
    early on some ranks, such as a broadcast's root).

    Args:
        rank: this rank.
    """
    status = oplog.rank_status(rank)
    for comm in status["comms"].values():
        comm["recent"] = comm["recent"][-REPLY_HISTORY:]
        if comm["members"][0] != rank:
            del comm["members"]
    return status


class StallInspector:
    """Watch this rank's operations; on rank 0, judge stalls for the whole job.

    Args:
        comm: an mpi4py communicator over every rank of the job, used only by the
            inspectors (it is duplicated; creating the inspector is collective).
        timeout: seconds an operation may wait before it counts as stalled.
        action: "abort" (end the job as above) or "warn" (only report).
        abort_after: seconds a stall may last before the job ends; 0 never.
    """

    #: seconds rank 0 waits for the ranks' answers in one round of questions
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
        self._processes: list = self._comm.allgather(liveness.this_process())
        self._asked = 0
        self._interval = max(0.05, min(1.0, timeout / 4))
        #: seconds a rank must stay silent (no answer, no CPU time) before it counts as lost
        self.lost_after = max(self.ANSWER_WITHIN_S, timeout)
        self._silent_since: dict[int, float] = {}
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
        self._answer_checks()
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
                self._send((episode, reply_status(self.rank)), 0, _REPLY)
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
        if self._unanswered_since is not None and now - self._unanswered_since > self.lost_after + 2 * self._interval:
            # Rank 0 answers every alarm within moments: it is gone, or cut off from here, or busy.
            doing = what_it_waits_in(oplog.rank_status(self.rank), self.size, {})
            where = f"rank {self.rank} on {self.hosts[self.rank]} waits in {doing} and rank 0 on {self.hosts[0]}"
            if self._busy([0], (r for r in range(1, self.size) if r not in self._exits)):
                self._unanswered_since = time.monotonic()
                self._report(
                    f"[hpcddp stall inspector] {where} is busy in a long call outside Python (CPU time advancing): "
                    "holding the GIL (a long sort, regex or pickle), it cannot answer this rank's alarm",
                    self._too_long(longest_wait({self.rank: oplog.rank_status(self.rank)})),
                )
                return
            self._report(
                f"[hpcddp stall inspector] {where} did not answer its alarm for {now - self._unanswered_since:.0f} s: "
                f"node {self.hosts[0]} is down or cut off from this node, or rank 0 died, is stopped, or hangs "
                "outside Python",
                "ranks were lost",
            )

    def _answer_alarms(self) -> bool:
        status = self._MPI.Status()
        alarmed = False
        while self._comm.Iprobe(tag=_ALARM, status=status):
            if self._recv(status.Get_source(), _ALARM) is _STALE:
                continue
            # Answer at once, report or not: a rank whose alarm goes unanswered ends itself.
            self._send(None, status.Get_source(), _QUERY)
            alarmed = True
        return alarmed

    def _tick_rank0(self) -> None:
        alarmed = self._answer_alarms()
        # After a rank left, look every tick: a rank waiting for it waits forever. While a rank
        # is silent, ask every tick too, until it answers or has been silent ``lost_after``.
        if not (alarmed or self._exits or self._silent_since or self._stalled()):
            return
        asked_at = time.monotonic()
        first, busy = self._gather()
        verdict = self._unless_silent_briefly(judge(first, self._exits, busy), first, busy, asked_at)
        if verdict == "deadlock":
            # Certain only if nothing changed meanwhile: see hpcddp.fault.stall.verdict.
            if self._stop.wait(self._interval):
                return
            second, busy = self._gather()
            if not stable(first, second):
                verdict = self._unless_silent_briefly(judge(second, self._exits, busy), second, busy, asked_at)
                verdict = "slow" if verdict == "deadlock" else verdict
            first = second
        self._act(first, busy, verdict)

    def _unless_silent_briefly(self, verdict: str, statuses: dict, busy: set[int], asked_at: float) -> str:
        """``verdict``, except "silent" for "lost" while no silent rank has been silent ``lost_after`` seconds.

        A rank is silent since the first round of questions it did not answer, after the
        last word heard from it (a late answer to an earlier round counts).
        """
        silent = {r for r, s in statuses.items() if s is None and r not in busy}
        self._silent_since = {r: self._silent_since.get(r, asked_at) for r in silent}
        if (
            verdict == "lost"
            and time.monotonic() - min(self._silent_since.values(), default=asked_at) < self.lost_after
        ):
            return "silent"
        return verdict

    def _gather(self) -> tuple[dict, set[int]]:
        """Every rank's status (None for a rank that does not answer in time), exited ranks left out.

        Also the ranks of those that did not answer which are ``_busy``.
        """
        self._episode += 1
        pending = {r for r in range(1, self.size) if r not in self._exits}
        for r in pending:
            self._send(self._episode, r, _QUERY)
        statuses: dict = {r: None for r in pending}
        statuses[0] = oplog.rank_status(0)
        deadline = time.monotonic() + max(self.ANSWER_WITHIN_S, 2 * self._interval)
        status = self._MPI.Status()
        while pending and time.monotonic() < deadline and not self._stop.is_set():
            self._answer_alarms()
            if self._comm.Iprobe(tag=_REPLY, status=status):
                message = self._recv(status.Get_source(), _REPLY)
                episode, answer = (None, None) if message is _STALE else message
                if episode == self._episode:
                    statuses[answer["rank"]] = answer
                    pending.discard(answer["rank"])
                elif answer is not None:
                    self._silent_since.pop(answer["rank"], None)  # a late answer: alive, its silence starts anew
                continue
            self._receive_byes()
            for r in pending & self._exits.keys():
                del statuses[r]
            pending -= self._exits.keys()
            time.sleep(0.01)
        if not pending or self._stop.is_set():
            return statuses, set()
        return statuses, self._busy(pending, (r for r, s in statuses.items() if s is not None))

    # -- ranks that do not answer -------------------------------------------------------
    def _busy(self, silent, answering) -> set[int]:
        """Return the ranks of ``silent`` whose process uses the CPU, read on their node (see ``liveness``).

        This rank reads those on its own node; for each other node it asks the first rank
        of ``answering`` there, and a node where none answers within ``ANSWER_WITHIN_S`` (a
        rank alone on its node, or a node lost) has no busy rank.
        """
        nodes: dict[str, list[int]] = {}
        for r in silent:
            if self._processes[r] is not None:
                nodes.setdefault(self._processes[r][0], []).append(r)
        mine = self._processes[self.rank]
        here = nodes.pop(mine[0], []) if mine is not None else []
        checkers: dict[str, int] = {}
        for r in answering:
            node = self._processes[r] and self._processes[r][0]
            if node in nodes and node not in checkers:
                checkers[node] = r
                if len(checkers) == len(nodes):
                    break
        self._asked += 1
        for node, r in checkers.items():
            self._send((self._asked, nodes[node]), r, _CHECK)
        busy = self._busy_here(here)
        waiting = set(checkers.values())
        deadline = time.monotonic() + self.ANSWER_WITHIN_S
        status = self._MPI.Status()
        while waiting and time.monotonic() < deadline and not self._stop.is_set():
            if self.rank == 0:
                self._answer_alarms()
            if self._comm.Iprobe(tag=_CHECKED, status=status):
                message = self._recv(status.Get_source(), _CHECKED)
                if message is not _STALE and message[0] == self._asked:
                    busy.update(message[1])
                    waiting.discard(status.Get_source())
                continue
            time.sleep(0.01)
        return busy

    def _busy_here(self, ranks: list[int]) -> set[int]:
        processes = {tuple(self._processes[r][1:]): r for r in ranks}
        return {processes[p] for p in liveness.busy_processes(list(processes))}

    def _answer_checks(self) -> None:
        status = self._MPI.Status()
        asks = []
        while self._comm.Iprobe(tag=_CHECK, status=status):
            message = self._recv(status.Get_source(), _CHECK)
            if message is not _STALE:
                asks.append((status.Get_source(), *message))
        if not asks:
            return
        # Every rank that waits may ask about a silent rank 0 at once: one reading answers them all.
        busy = self._busy_here(sorted({r for *_, ranks in asks for r in ranks}))
        for source, asked, ranks in asks:
            self._send((asked, [r for r in ranks if r in busy]), source, _CHECKED)

    # -- verdicts ---------------------------------------------------------------------
    def _act(self, statuses: dict, busy: set[int], verdict: str) -> None:
        if self._stop.is_set():
            return  # this rank is leaving: what it saw may be the others leaving too
        report = explain_stall(statuses, self._exits, self.size, self.timeout, self.hosts, busy)
        reason, code, sooner = None, 1, None
        if verdict == "lost":
            reason = "ranks were lost"
        elif verdict == "exited":
            reason, code = exit_reason(statuses, self._exits)
        elif verdict == "deadlock":
            reason = "every rank waits in an operation that can never complete (seen twice)"
        else:
            longest = longest_wait(statuses)
            if longest < self.timeout:
                return  # a rank left or alarmed, and nothing waits any more
            reason = self._too_long(longest)
            if verdict == "silent":
                sooner = (
                    f"a rank silent for {self.lost_after:g} s in all is taken for lost (the stall timeout, "
                    f"at least {self.ANSWER_WITHIN_S:g} s), which ends the job"
                )
        self._report(report, reason, code, sooner)

    def _too_long(self, longest: float) -> str | None:
        if self.abort_after and longest >= self.abort_after:
            return f"the stall has lasted {longest:.0f} s (stall_abort_after={self.abort_after:g} s)"
        return None

    def _report(self, report: str, reason: str | None, code: int = 1, sooner: str | None = None) -> None:
        """Abort for ``reason`` (with stall_action="abort"), else warn at most once per ``timeout``.

        Args:
            report: what the ranks wait in.
            reason: why the job ends now, or None.
            code: the exit code it ends with.
            sooner: what ends the job before ``stall_abort_after`` (a silent rank), for the warning.
        """
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
            if sooner is not None:
                outcome += f"; {sooner}"
        else:
            outcome = (
                f"the job never ends for it (stall_action={self.action!r}, stall_abort_after={self.abort_after:g})"
            )
            if sooner is not None and self.action == "abort":
                outcome += f", but {sooner}"
        log.warning("%s\n[hpcddp stall inspector] still waiting; %s", report, outcome)
