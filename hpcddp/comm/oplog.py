"""What this rank's communicators are doing: the logs the stall inspector reads.

Every communicator keeps an ``OperationLog``: the operations it has started, in the
order every member rank must share (numbered from 1), the one(s) running, and the
point-to-point messages in flight. Threads that block in hpcddp (a ``wait()``, a
blocking collective) say so with ``waiting``. Nothing here sends anything: the
inspector reads ``rank_status()`` when it needs to (see ``hpcddp.fault.stall.inspector``).
Recording is a few dictionary operations under a lock per event, on the hot path.
The threads that submit collectives are noted too (``is_collective_thread``): the
exception hook ends the job when one of them dies of an uncaught exception.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

__all__ = [
    "Descriptor",
    "OperationLog",
    "describe",
    "is_collective_thread",
    "logs",
    "mark_collective_thread",
    "is_patient",
    "patient_collectives",
    "rank_status",
    "register",
    "started_counts",
    "wait_begins",
    "wait_ends",
    "unregister",
    "waiting",
]


class _Patience(threading.local):
    patient = False


_patience = _Patience()


@contextlib.contextmanager
def patient_collectives() -> Iterator[None]:
    """Exempt the collectives submitted by this thread in this block from the stall timeout.

    For waits that are long by design, such as ranks waiting for rank 0 to write a
    large checkpoint: a block of many collectives (of several APIs), not one call.
    """
    previous = _patience.patient
    _patience.patient = True
    try:
        yield
    finally:
        _patience.patient = previous


class Descriptor(NamedTuple):
    """One operation, as stall reports name it.

    A NamedTuple, not a dataclass: one is made per collective on the hot path.
    """

    #: its place in its communicator's order (1, 2, ...); 0 until it starts
    seq: int
    op: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    #: what it is for, e.g. "bucket 2 of step 7"
    label: str = ""
    step: int | None = None
    #: exempt from the stall timeout (see ``patient_collectives``)
    patient: bool = False

    def for_step(self, label: str, step: int | None) -> Descriptor:
        """This operation labelled ``label`` in ``step``: a gradient bucket's, named once per step."""
        # Not _replace(), which costs four times as much: once per bucket on the step's path.
        return tuple.__new__(Descriptor, (self[0], self[1], self[2], self[3], label, step, self[6]))

    def match_key(self) -> tuple:
        """What must agree across ranks at one place of the order (the stall inspector groups ranks by it)."""
        return (self.op, self.shape, self.dtype)

    def __str__(self) -> str:
        text = f"{self.op} #{self.seq}" if self.seq else self.op
        if self.shape is not None:
            text += f" of shape {list(self.shape)} {self.dtype}"
        return text + (f" ({self.label})" if self.label else "")


def is_patient() -> bool:
    """True inside ``patient_collectives`` on this thread (``describe`` reads it: a cache key for planned descriptors)."""
    return _patience.patient


def describe(op: str, shape=None, dtype: str | None = None, *, label: str = "", step: int | None = None) -> Descriptor:
    """Return the descriptor of an operation submitted now by this thread (its patience included).

    Args:
        op: the operation (``hpcddp.comm.names``).
        shape: its tensor's shape, if any.
        dtype: its tensor's dtype name, if any.
        label: what it is for, e.g. "bucket 2 of step 7" (stall reports name it).
        step: the training step it belongs to, compared across ranks.
    """
    mark_collective_thread()
    return Descriptor(0, op, None if shape is None else tuple(shape), dtype, label, step, _patience.patient)


# Thread objects, not idents: an ident is reused once its thread ends.
_collective_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


class _Marked(threading.local):
    done = False


_marked = _Marked()


def mark_collective_thread() -> None:
    """Note that the calling thread takes part in collectives (it submitted one, or steps an averager)."""
    if not _marked.done:  # once per thread: this runs on every small collective's hot path
        _collective_threads.add(threading.current_thread())
        _marked.done = True


def is_collective_thread(thread: threading.Thread) -> bool:
    """True when ``thread`` took part in collectives: its ranks' peers may wait for its next one."""
    return thread in _collective_threads


class _Activity:
    """Rank-wide: the threads blocked in hpcddp, and a count of every change the inspector compares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.progress = 0
        #: token -> (communicator key, what, since, the waiting thread's ident)
        self.waits: dict[int, tuple[str | None, object, float, int]] = {}
        self._tokens = itertools.count()


_activity = _Activity()
_logs: dict[int, OperationLog] = {}
_logs_lock = threading.Lock()
# How far closed communicators got: a rank that leaves reports these too, so that a
# peer still finishing the last operation of a communicator this rank closed is not
# taken for one waiting forever. The newest thousand are kept.
_closed_counts: dict[str, int] = {}
_closed_changes = 0
_KEEP_CLOSED = 1000


def wait_begins(log: OperationLog | None, what: object) -> int:
    """Record that this thread blocks until ``what`` (an operation or message of ``log``) completes; return a token."""
    token = next(_activity._tokens)
    entry = (None if log is None else log.key, what, time.monotonic(), threading.get_ident())
    with _activity.lock:
        _activity.waits[token] = entry
        _activity.progress += 1
    return token


def wait_ends(token: int) -> None:
    """Record that the wait of ``token`` is over."""
    with _activity.lock:
        del _activity.waits[token]
        _activity.progress += 1


@contextlib.contextmanager
def waiting(log: OperationLog | None, what: object) -> Iterator[None]:
    """``wait_begins`` / ``wait_ends`` around a block."""
    token = wait_begins(log, what)
    try:
        yield
    finally:
        wait_ends(token)


class OperationLog:
    """The operations of one communicator on this rank, in the order its members share.

    Args:
        key: the same on every member rank and different for every communicator.
        members: the communicator's ranks as ranks of the whole job, in its order.
        history: how many finished operations to remember for reports.
    """

    def __init__(self, key: str, members: tuple[int, ...], history: int = 32) -> None:
        self.key = key
        self.members = tuple(members)
        self._lock = threading.Lock()
        #: operations started so far; the last one started has this number
        self.started = 0
        #: every start, finish and message: equal counts in two snapshots mean nothing happened
        self.changes = 0
        self.last_step: int | None = None
        self._last_start = time.monotonic()
        self._recent: deque[tuple[int, Descriptor]] = deque(maxlen=history)
        # Several at once: nested operations (a callback's collective inside another's
        # completion), or gloo/nccl, whose operations overlap. The oldest is reported.
        # seq -> (descriptor, since, blocking: the ident of the user's thread that runs it and waits, else 0)
        self._running: dict[int, tuple[Descriptor, float, int]] = {}
        self._p2p: dict[int, tuple[str, int, int, float]] = {}
        self._p2p_tokens = itertools.count(1)
        self._refreshers: list = []

    def add_refresher(self, refresh) -> None:
        """Call ``refresh()`` before each look at the running operations.

        For a backend that learns of completions only when asked: nccl's Work futures
        complete when the kernel is queued, so its communicator finishes an operation once
        a CUDA event says the kernel ran (``hpcddp.comm.torchdist``).
        """
        self._refreshers.append(refresh)

    def _refresh(self) -> None:
        for refresh in self._refreshers:
            refresh()

    def start(self, pending: Descriptor, blocking: bool = False) -> int:
        """Number ``pending`` as the next operation of this communicator, mark it running, return its number.

        Args:
            pending: from ``describe``.
            blocking: the calling thread runs it and waits for it (counts as a wait).
        """
        now = time.monotonic()
        with self._lock:
            self.started += 1
            self.changes += 1
            seq = self.started
            self._running[seq] = (pending, now, threading.get_ident() if blocking else 0)
            self._recent.append((seq, pending))
            self._last_start = now
            if pending.step is not None:
                self.last_step = pending.step
        return seq

    def finish(self, seq: int) -> None:
        """Mark operation ``seq`` completed (or failed)."""
        with self._lock:
            self._running.pop(seq, None)
            self.changes += 1

    def post(self, kind: str, peer: int | None, tag: int) -> int:
        """Record a point-to-point message in flight; return a token for ``delivered``.

        Args:
            kind: "send" or "recv".
            peer: the other rank, as a rank of the whole job; None for any source.
            tag: the user's tag.
        """
        with self._lock:
            token = next(self._p2p_tokens)
            self._p2p[token] = (kind, peer, tag, time.monotonic())
            self.changes += 1
        return token

    def delivered(self, token: int) -> None:
        """Record that the message of ``token`` completed."""
        with self._lock:
            self._p2p.pop(token, None)
            self.changes += 1

    def running(self) -> tuple[Descriptor | None, float]:
        """Return the oldest running operation (numbered) and for how many seconds it has run."""
        self._refresh()
        with self._lock:
            if not self._running:
                return None, 0.0
            seq = min(self._running)
            desc, since, _ = self._running[seq]
        return desc._replace(seq=seq), time.monotonic() - since

    def status(self) -> dict:
        """A picklable snapshot for the inspector (descriptors numbered)."""
        self._refresh()
        now = time.monotonic()
        with self._lock:
            running = sorted((seq, d, now - t, b) for seq, (d, t, b) in self._running.items())
            return {
                "members": self.members,
                "size": len(self.members),
                "started": self.started,
                "changes": self.changes,
                "running": [(d._replace(seq=seq), age) for seq, d, age, _ in running],
                "blocking": any(b for *_, b in running),
                "blocking_threads": [b for *_, b in running if b],
                "p2p": [(kind, peer, tag, now - t) for kind, peer, tag, t in self._p2p.values()],
                "recent": [d._replace(seq=seq) for seq, d in self._recent],
                "last_step": self.last_step,
                "idle": now - self._last_start,
            }


def register(log: OperationLog) -> None:
    """Let the stall inspector see ``log`` (until ``unregister``)."""
    with _logs_lock:
        _logs[id(log)] = log


def unregister(log: OperationLog) -> None:
    """Stop showing ``log`` to the stall inspector (its communicator closed)."""
    global _closed_changes
    with _logs_lock:
        if _logs.pop(id(log), None) is not None:
            _closed_counts[log.key] = log.started
            _closed_changes += log.changes + 1
            while len(_closed_counts) > _KEEP_CLOSED:
                del _closed_counts[next(iter(_closed_counts))]


def started_counts() -> dict[str, int]:
    """How many operations this rank started on each communicator, closed ones included."""
    with _logs_lock:
        counts = dict(_closed_counts)
        counts.update((log.key, log.started) for log in _logs.values())
    return counts


def logs() -> list[OperationLog]:
    """The registered logs."""
    with _logs_lock:
        return list(_logs.values())


def rank_status(rank: int) -> dict:
    """Everything the inspector compares for this rank, as one picklable dict.

    ``waits`` lists the threads blocked in hpcddp (a thread that runs an operation it
    waits for counts too); ``progress`` changes with every event on this rank.
    """
    with _logs_lock:
        closed = _closed_changes
    comms = {log.key: log.status() for log in logs()}
    now = time.monotonic()
    with _activity.lock:
        waits = [(key, str(what), now - since) for key, what, since, _ in _activity.waits.values()]
        progress = _activity.progress
    waits += [(key, str(c["running"][0][0]), c["running"][0][1]) for key, c in comms.items() if c["blocking"]]
    progress += closed + sum(c["changes"] for c in comms.values())
    return {
        "rank": rank,
        "comms": comms,
        "waits": waits,
        "progress": progress,
        "cpu": _cpu_outside_hpcddp({t for c in comms.values() for t in c["blocking_threads"]}),
        "clock": now,
    }


def _cpu_outside_hpcddp(blocking: set[int]) -> float:
    """CPU seconds this process spent outside hpcddp's waits (hpcddp.fault.stall.verdict.stable).

    The whole process (every thread, torch's intra-op threads and threads that ended
    included) less the threads inside hpcddp now: hpcddp's own, and those waiting in
    hpcddp or running an operation they wait for (MPI may busy-poll there: that is
    waiting, not computing). Which threads are inside cannot change between two
    snapshots with the same progress counter, so differences are exact.
    """
    total = time.process_time()
    with _activity.lock:
        inside = blocking | {thread for *_, thread in _activity.waits.values()}
    for thread in threading.enumerate():
        if thread.ident is None or not (thread.ident in inside or thread.name.startswith("hpcddp-")):
            continue
        try:
            total -= time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, AttributeError):  # the thread ended meanwhile, or no per-thread clocks here
            continue
    return total
