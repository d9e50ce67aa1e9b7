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
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["CollectiveLog", "Descriptor", "StallInspector", "collective_tag", "explain_stall", "patient_collectives"]

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
        self.running: Descriptor | None = None
        self.running_since = 0.0

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
                self.running, self.running_since = desc, now
        return desc

    def start(self, desc: Descriptor) -> None:
        with self._lock:
            self.running, self.running_since = desc, time.monotonic()

    def finish(self) -> None:
        with self._lock:
            self.running = None

    def waited(self) -> tuple[Descriptor | None, float]:
        """Return the collective this rank is blocked in and for how many seconds."""
        with self._lock:
            if self.running is None:
                return None, 0.0
            return self.running, time.monotonic() - self.running_since

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


def explain_stall(statuses: dict[int, dict | None], size: int, timeout: float) -> str:
    """Return the stall report: which ranks are missing, what they wait for, the likely cause.

    Args:
        statuses: each rank's ``CollectiveLog.status``; None for a rank that did not answer.
        size: the number of ranks.
        timeout: the stall timeout, quoted in the report.
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
        lines.append(f"  {_ranks(silent)} did not answer the inspector: hung outside Python (holding the GIL) or dead")
    late = sorted(
        set(missing) | set(silent) | {r for sig, rs in groups.items() if sig != reference.signature() for r in rs}
    )
    lines.append(f"  waiting: {_ranks(sorted(waiting))}; missing or different: {_ranks(late) if late else 'none'}")
    return "\n".join(lines)


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

    Args:
        comm: an mpi4py communicator used only by the inspectors (a Dup).
        collectives: this rank's CollectiveLog.
        timeout: seconds a collective may wait before it counts as stalled.
        action: "abort" or "warn".
    """

    def __init__(self, comm, collectives: CollectiveLog, timeout: float, action: str) -> None:
        self._comm = comm
        self._log = collectives
        self.timeout = timeout
        self.action = action
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._interval = max(0.05, min(1.0, timeout / 4))
        self._stop = threading.Event()
        self._alarmed: int | None = None
        self._next_report = 0.0
        self._episode = 0
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

    def _tick(self) -> None:
        running, waited = self._log.waited()
        stalled = running is not None and not running.patient and waited >= self.timeout
        if self.rank != 0:
            while self._comm.Iprobe(source=0, tag=_QUERY):
                episode = self._comm.recv(source=0, tag=_QUERY)
                self._comm.send((episode, self._log.status(self.rank)), dest=0, tag=_REPLY)
            if stalled and self._alarmed != running.seq:
                self._alarmed = running.seq
                self._comm.send(running.seq, dest=0, tag=_ALARM)
            if stalled and waited >= 3 * self.timeout + 10:
                # Rank 0 should have reported long ago: its inspector cannot run.
                self._act(
                    f"[hpcddp stall inspector] rank {self.rank} has waited {waited:.0f} s in {running} and rank 0 "
                    "did not report: rank 0 is hung outside Python (holding the GIL) or dead"
                )
            return
        alarmed = False
        while self._comm.Iprobe(tag=_ALARM):
            self._comm.recv(tag=_ALARM)
            alarmed = True
        if (stalled or alarmed) and time.monotonic() >= self._next_report:
            report = explain_stall(self._gather(), self.size, self.timeout)
            self._act(report)

    def _gather(self) -> dict[int, dict | None]:
        self._episode += 1
        for r in range(1, self.size):
            self._comm.send(self._episode, dest=r, tag=_QUERY)
        statuses: dict[int, dict | None] = {r: None for r in range(1, self.size)}
        statuses[0] = self._log.status(0)
        deadline = time.monotonic() + max(5.0, 2 * self._interval)
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

    def _act(self, report: str) -> None:
        if self.action == "abort":
            from ._abort import abort_job

            abort_job(report + "\n[hpcddp stall inspector] aborting the job (stall_action='abort')", use_mpi=True)
        if time.monotonic() < self._next_report:
            return
        self._next_report = time.monotonic() + self.timeout
        log.warning("%s\n[hpcddp stall inspector] still waiting (stall_action='warn')", report)
