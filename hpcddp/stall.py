"""Stall inspector: name the ranks that keep the others waiting in a collective, and why.

As Horovod's stall check, but without its per-tensor negotiation: every collective
the mpi backend submits gets a sequence number and a short descriptor (op, shape,
dtype, and a tag such as "bucket 2 of step 7"), recorded locally. A thread on each
rank wakes once a second and looks at the collective its communication thread is
blocked in; nothing is sent while no collective has waited ``timeout`` seconds.
Then the waiting rank alarms rank 0, rank 0 asks every rank for its recent
descriptors over a communicator of its own (point-to-point, so ranks stuck in the
collective can still answer from this thread), compares them, prints which ranks
are missing, what they wait for and the likely cause, and aborts or only warns.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

__all__ = [
    "CollectiveLog",
    "Descriptor",
    "StallInspector",
    "collective_tag",
    "explain_stall",
    "patient_collectives",
    "stall_verdict",
]

log = logging.getLogger("hpcddp")

_ALARM, _QUERY, _REPLY = 71, 72, 73
_tag = threading.local()


@contextlib.contextmanager
def collective_tag(tag: str, step: int | None = None) -> Iterator[None]:
    """Label the collectives submitted in this block (for stall reports).

    Args:
        tag: what the collective is for, e.g. "bucket 2 of step 7".
        step: the training step it belongs to, compared across ranks.
    """
    previous = getattr(_tag, "value", None)
    _tag.value = (tag, step)
    try:
        yield
    finally:
        _tag.value = previous


@contextlib.contextmanager
def patient_collectives() -> Iterator[None]:
    """Exempt the collectives submitted in this block from the stall timeout.

    For waits that are long by design, such as ranks waiting for rank 0 to write a
    large checkpoint.
    """
    previous = getattr(_tag, "patient", False)
    _tag.patient = True
    try:
        yield
    finally:
        _tag.patient = previous


class Descriptor(NamedTuple):
    """One submitted collective, as the stall report names it.

    A NamedTuple, not a dataclass: one is made per collective on the hot path, and
    a frozen dataclass costs several times more to build.
    """

    seq: int
    op: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    tag: str = ""
    step: int | None = None
    #: exempt from the stall timeout (see ``patient_collectives``)
    patient: bool = False

    def signature(self) -> tuple:
        """What must agree across ranks for the collective to match."""
        return (self.op, self.shape, self.dtype)

    def __str__(self) -> str:
        text = f"{self.op} #{self.seq}"
        if self.shape is not None:
            text += f" of shape {list(self.shape)} {self.dtype}"
        return text + (f" ({self.tag})" if self.tag else "")


class CollectiveLog:
    """Record of the collectives one rank submitted and the one it is blocked in."""

    def __init__(self, history: int = 256) -> None:
        self._lock = threading.Lock()
        self.seq = 0
        self.recent: deque[Descriptor] = deque(maxlen=history)
        self.last_step: int | None = None
        self.last_submit_time = time.monotonic()
        # seq -> (descriptor, since): one entry on the mpi backend's thread, several
        # on gloo/nccl, whose collectives run concurrently; the oldest is reported.
        self._in_flight: dict[int, tuple[Descriptor, float]] = {}

    def submit(self, op: str, shape=None, dtype=None, start: bool = False) -> Descriptor:
        """Number the next collective; call under the lock that orders submissions.

        Args:
            op: the collective's name.
            shape: the tensor's shape, if any.
            dtype: the tensor's dtype name, if any.
            start: the caller runs it right away (as ``start`` would record).
        """
        tag, step = getattr(_tag, "value", None) or ("", None)
        self.seq += 1
        desc = Descriptor(self.seq, op, shape and tuple(shape), dtype, tag, step, getattr(_tag, "patient", False))
        self.recent.append(desc)
        if step is not None:
            self.last_step = step
        now = time.monotonic()
        self.last_submit_time = now
        if start:
            with self._lock:
                self._in_flight[desc.seq] = (desc, now)
        return desc

    def start(self, desc: Descriptor) -> None:
        """Record that ``desc`` is now running (waiting for the other ranks)."""
        with self._lock:
            self._in_flight[desc.seq] = (desc, time.monotonic())

    def finish(self, desc: Descriptor | None = None) -> None:
        """Record that ``desc`` (default: every running collective) has completed."""
        with self._lock:
            if desc is None:
                self._in_flight.clear()
            else:
                self._in_flight.pop(desc.seq, None)

    def waited(self) -> tuple[Descriptor | None, float]:
        """Return the oldest collective this rank is blocked in and for how many seconds."""
        with self._lock:
            if not self._in_flight:
                return None, 0.0
            desc, since = next(iter(self._in_flight.values()))
            return desc, time.monotonic() - since

    def status(self, rank: int) -> dict:
        running, waited = self.waited()
        return {
            "rank": rank,
            "running": running,
            "waited": waited,
            "recent": list(self.recent),
            "last_step": self.last_step,
            "idle": time.monotonic() - self.last_submit_time,
        }


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _at(status: dict, seq: int) -> Descriptor | None:
    running = status["running"]
    if running is not None and running.seq == seq:  # may have left a short history already
        return running
    return next((d for d in status["recent"] if d.seq == seq), None)


def explain_stall(
    statuses: dict[int, dict | None], size: int, timeout: float, hosts: Sequence[str] | None = None
) -> str:
    """Return the stall report: which ranks are missing, what they wait for, the likely cause.

    Args:
        statuses: each rank's ``CollectiveLog.status``; None for a rank that did not answer.
        size: the number of ranks.
        timeout: the stall timeout, quoted in the report.
        hosts: every rank's host name, to name the node of ranks that did not answer.
    """
    waiting = {r: s for r, s in statuses.items() if s is not None and s["running"] is not None}
    if not waiting:
        return "[hpcddp stall inspector] no rank is waiting in a collective any more"
    seq = min(s["running"].seq for s in waiting.values())
    longest = max(s["waited"] for s in waiting.values())
    lines = [f"[hpcddp stall inspector] collective #{seq} has waited {longest:.0f} s (stall_timeout={timeout:g} s):"]
    at_seq = {r: _at(s, seq) for r, s in statuses.items() if s is not None}
    at_seq = {r: d for r, d in at_seq.items() if d is not None}
    reference_rank = min(r for r, s in waiting.items() if s["running"].seq == seq)
    reference = at_seq[reference_rank]
    steps = {r: s["last_step"] for r, s in statuses.items() if s is not None and s["last_step"] is not None}
    missing = [r for r in range(size) if statuses.get(r) is not None and r not in at_seq]
    silent = [r for r in range(size) if statuses.get(r) is None]
    groups: dict[tuple, list[int]] = {}
    for r, d in sorted(at_seq.items()):
        groups.setdefault(d.signature(), []).append(r)
    lines.append(f"  {_ranks(groups[reference.signature()])} submitted {reference}")
    for signature, ranks in groups.items():
        if signature == reference.signature():
            continue
        other = at_seq[ranks[0]]
        lines.append(f"  {_ranks(ranks)} submitted {other} instead")
        lines.append("    likely cause: " + _mismatch_cause(reference, other, ranks, steps, reference_rank))
    for r in missing:
        status = statuses[r]
        last = status["recent"][-1] if status["recent"] else None
        if last is not None and last.seq > seq:
            lines.append(f"  rank {r} is past #{seq} (its history no longer holds it); it waits in {status['running']}")
            continue
        doing = f"it waits in {status['running']}" if status["running"] else "it waits in no collective"
        lines.append(
            f"  rank {r} did not submit {reference.op} #{seq}"
            + (f" ({reference.tag})" if reference.tag else "")
            + f": its last collective was {last or 'none'}, {status['idle']:.0f} s ago, and {doing}"
        )
        if reference.step is not None:
            cause = (
                "it skipped a backward or called step() early, ran out of data (wrap the loop in "
                "hpcddp.join(optimizer)), or is busy outside hpcddp (evaluation, checkpointing, a slow data loader)"
            )
        else:
            cause = (
                "it is busy outside hpcddp (evaluation, checkpointing, a slow data loader) or took another code path"
            )
        lines.append("    likely cause: " + cause)
    if silent:
        lines.extend(_describe_silent(silent, size, hosts))
    late = sorted(
        set(missing) | set(silent) | {r for sig, rs in groups.items() if sig != reference.signature() for r in rs}
    )
    lines.append(f"  waiting: {_ranks(sorted(waiting))}; missing or different: {_ranks(late) if late else 'none'}")
    return "\n".join(lines)


def _describe_silent(silent: list[int], size: int, hosts: Sequence[str] | None) -> list[str]:
    if not hosts:
        return [
            f"  {_ranks(silent)} did not answer the inspector: dead, cut off, or hung outside Python (holding the GIL)"
        ]
    lines = []
    by_host: dict[str, list[int]] = {}
    for r in silent:
        by_host.setdefault(hosts[r], []).append(r)
    for host, ranks in by_host.items():
        everyone = [r for r in range(size) if hosts[r] == host]
        if ranks == everyone:
            lines.append(
                f"  node {host} is lost: {_ranks(ranks)} on it did not answer the inspector "
                "(node down or cut off from the others, or its processes died)"
            )
        else:
            lines.append(
                f"  {_ranks(ranks)} on node {host} did not answer the inspector: dead, or hung outside Python "
                "(holding the GIL)"
            )
    return lines


def stall_verdict(statuses: dict[int, dict | None]) -> str:
    """Classify a stall: "lost" (a rank did not answer), "deadlock" (every rank waits, in
    collectives that cannot match), or "slow" (some rank is busy and may still come).

    Args:
        statuses: as for ``explain_stall``.
    """
    if any(status is None for status in statuses.values()):
        return "lost"
    running = [status["running"] for status in statuses.values()]
    if all(desc is not None for desc in running) and len({(d.seq, d.signature()) for d in running}) > 1:
        return "deadlock"
    return "slow"


def _mismatch_cause(reference: Descriptor, other: Descriptor, ranks, steps, reference_rank) -> str:
    if (
        reference.op == other.op
        and reference.step is not None
        and other.step is not None
        and reference.step == other.step
    ):
        return "different models on different ranks (check the parameter lists), or data-dependent shapes"
    if reference.op == other.op and reference.shape != other.shape and reference.step is None:
        return "data-dependent shapes: every rank must pass a tensor of the same shape and dtype"
    ref_step, other_step = steps.get(reference_rank), steps.get(ranks[0])
    if ref_step is not None and other_step is not None and ref_step != other_step:
        behind = ranks if other_step < ref_step else [reference_rank]
        return (
            f"{_ranks(behind)} reduced gradients for fewer steps (last step {min(ref_step, other_step)} "
            f"vs {max(ref_step, other_step)}): skipped a backward or called step() early, or ran out of data "
            "(wrap the loop in hpcddp.join(optimizer))"
        )
    return "the ranks call collectives in different orders (a rank-dependent branch around a collective)"


class StallInspector:
    """The thread on each rank that notices a stalled collective and reports it.

    Policy, as the tools users know (Horovod warns at 60 s, torch.distributed ends
    a collective after 30 min): a stall is reported as a warning after ``timeout``
    and repeated every ``timeout``; the job is ended when ranks did not answer the
    inspector (dead, or their node is down or cut off), when every rank waits in
    collectives that can never match (a deadlock), or when the stall has lasted
    ``abort_after`` seconds. A rank whose alarm rank 0 never answers (rank 0's node
    is cut off) ends itself, so that no rank outlives a lost node.

    Args:
        comm: an mpi4py communicator used only by the inspectors (a Dup). Creating
            the inspector is collective over it (the ranks exchange host names).
        collectives: this rank's CollectiveLog.
        timeout: seconds a collective may wait before it counts as stalled.
        action: "abort" (end the job as above) or "warn" (only report).
        abort_after: seconds a stall may last before the job ends; 0 never.
    """

    #: seconds rank 0 waits for the ranks' answers; a rank that does not answer is lost
    ANSWER_WITHIN_S = 10.0

    def __init__(self, comm, collectives: CollectiveLog, timeout: float, action: str, abort_after: float = 0) -> None:
        self._comm = comm
        self._log = collectives
        self.timeout = timeout
        self.action = action
        self.abort_after = abort_after
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.hosts: list[str] = comm.allgather(socket.gethostname())
        self._interval = max(0.05, min(1.0, timeout / 4))
        self._stop = threading.Event()
        self._alarmed: int | None = None
        self._alarmed_at = 0.0
        self._unanswered_since: float | None = None  # the first alarm rank 0 has not answered
        self._next_report = 0.0
        self._episode = 0
        self._sends: list = []  # requests in flight: a lost peer must not block this thread
        self._thread = threading.Thread(target=self._run, name="hpcddp-stall", daemon=True)
        self._thread.start()
        # Stop before mpi4py finalises MPI at exit, which a probing thread could crash.
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self._tick()
        except Exception:  # noqa: BLE001 - a broken inspector must not end training
            log.exception("hpcddp: the stall inspector failed and is off for this run")

    def _mpi_status(self):
        from ._mpi import import_mpi

        return import_mpi().Status()

    def _send(self, obj, dest: int, tag: int) -> None:
        self._sends = [request for request in self._sends if not request.Test()]
        self._sends.append(self._comm.isend(obj, dest=dest, tag=tag))

    def _tick(self) -> None:
        running, waited = self._log.waited()
        stalled = running is not None and not running.patient and waited >= self.timeout
        if self.rank != 0:
            self._tick_other(running, waited, stalled)
            return
        alarmed = False
        status = self._mpi_status()
        while self._comm.Iprobe(tag=_ALARM, status=status):
            self._comm.recv(source=status.Get_source(), tag=_ALARM)
            # Answer at once, report or not: a rank whose alarm goes unanswered ends itself.
            self._send(None, dest=status.Get_source(), tag=_QUERY)
            alarmed = True
        if (stalled or alarmed) and time.monotonic() >= self._next_report:
            statuses = self._gather()
            report = explain_stall(statuses, self.size, self.timeout, self.hosts)
            longest = max((s["waited"] for s in statuses.values() if s is not None), default=0.0)
            self._act(report, stall_verdict(statuses), longest)

    def _tick_other(self, running: Descriptor | None, waited: float, stalled: bool) -> None:
        while self._comm.Iprobe(source=0, tag=_QUERY):
            episode = self._comm.recv(source=0, tag=_QUERY)
            self._unanswered_since = None
            if episode is not None:  # None only acknowledges an alarm
                self._send((episode, self._log.status(self.rank)), dest=0, tag=_REPLY)
        now = time.monotonic()
        # Alarm again every timeout while stalled: rank 0, maybe busy itself, repeats its
        # warning and ends the job once the stall lasts stall_abort_after.
        if stalled and (self._alarmed != running.seq or now - self._alarmed_at >= self.timeout):
            self._alarmed, self._alarmed_at = running.seq, now
            if self._unanswered_since is None:
                self._unanswered_since = now
            self._send(running.seq, dest=0, tag=_ALARM)
        unanswered = self._unanswered_since is not None and now - self._unanswered_since
        if stalled and unanswered and unanswered > self.ANSWER_WITHIN_S + 2 * self._interval:
            # Rank 0 asks every rank within moments of an alarm: it is gone, or cut off from here.
            self._act(
                f"[hpcddp stall inspector] rank {self.rank} on {self.hosts[self.rank]} has waited {waited:.0f} s in "
                f"{running} and rank 0 on {self.hosts[0]} did not answer its alarm: node {self.hosts[0]} is down or "
                "cut off from this node, or rank 0 died or hangs outside Python (holding the GIL)",
                "lost",
                waited,
            )

    def _gather(self) -> dict[int, dict | None]:
        self._episode += 1
        for r in range(1, self.size):
            self._send(self._episode, dest=r, tag=_QUERY)
        statuses: dict[int, dict | None] = {r: None for r in range(1, self.size)}
        statuses[0] = self._log.status(0)
        deadline = time.monotonic() + max(self.ANSWER_WITHIN_S, 2 * self._interval)
        pending = set(range(1, self.size))
        while pending and time.monotonic() < deadline:
            if self._comm.Iprobe(tag=_REPLY):
                episode, status = self._comm.recv(tag=_REPLY)
                if episode == self._episode:
                    statuses[status["rank"]] = status
                    pending.discard(status["rank"])
            else:
                time.sleep(0.02)
        return statuses

    def _act(self, report: str, verdict: str, waited: float) -> None:
        if self.action == "abort":
            reason = {
                "lost": "ranks were lost",
                "deadlock": "the ranks wait in collectives that cannot match",
            }.get(verdict)
            if reason is None and self.abort_after and waited >= self.abort_after:
                reason = f"the stall has lasted {waited:.0f} s (stall_abort_after={self.abort_after:g} s)"
            if reason is not None:
                from ._abort import abort_job

                abort_job(f"{report}\n[hpcddp stall inspector] aborting the job: {reason}", use_mpi=True)
        if time.monotonic() < self._next_report:
            return
        self._next_report = time.monotonic() + self.timeout
        if self.action == "abort" and self.abort_after:
            outcome = f"the job ends if it lasts {self.abort_after:g} s (stall_abort_after, HPCDDP_STALL_ABORT_AFTER)"
        else:
            outcome = (
                f"the job never ends for it (stall_action={self.action!r}, stall_abort_after={self.abort_after:g})"
            )
        log.warning("%s\n[hpcddp stall inspector] still waiting; %s", report, outcome)
