"""What this rank's communicators are doing: the logs the stall inspector reads.

Every communicator keeps an ``OperationLog``: the operations it has started, in the
order every member rank must share (numbered from 1), the one(s) running, and the
point-to-point messages in flight. Threads that block in hpcddp (a ``wait()``, a
blocking collective) say so with ``waiting``. Nothing here sends anything: the
inspector reads ``rank_status()`` when it needs to (see ``hpcddp.stall.inspector``).
Recording is a few dictionary operations under a lock per event, on the hot path.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

__all__ = [
    "Descriptor",
    "OperationLog",
    "collective_tag",
    "current_tag",
    "describe",
    "logs",
    "patient_collectives",
    "rank_status",
    "register",
    "started_counts",
    "unregister",
    "waiting",
]

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
    """One operation, as stall reports name it.

    A NamedTuple, not a dataclass: one is made per collective on the hot path.
    """

    #: its place in its communicator's order (1, 2, ...); 0 until it starts
    seq: int
    op: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    tag: str = ""
    step: int | None = None
    #: exempt from the stall timeout (see ``patient_collectives``)
    patient: bool = False

    def signature(self) -> tuple:
        """What must agree across ranks for the operation to match."""
        return (self.op, self.shape, self.dtype)

    def __str__(self) -> str:
        text = f"{self.op} #{self.seq}" if self.seq else self.op
        if self.shape is not None:
            text += f" of shape {list(self.shape)} {self.dtype}"
        return text + (f" ({self.tag})" if self.tag else "")


def current_tag() -> tuple[str, int | None]:
    """The tag and step of ``collective_tag`` around this thread's submissions, or ("", None)."""
    return getattr(_tag, "value", None) or ("", None)


def describe(op: str, shape=None, dtype: str | None = None) -> Descriptor:
    """Return the descriptor of an operation submitted now by this thread (its tag and patience included)."""
    tag, step = getattr(_tag, "value", None) or ("", None)
    return Descriptor(0, op, None if shape is None else tuple(shape), dtype, tag, step, getattr(_tag, "patient", False))


class _Activity:
    """Rank-wide: the threads blocked in hpcddp, and a counter of every change the inspector compares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.progress = 0
        self.waits: dict[int, tuple[str | None, str, float]] = {}
        self._tokens = itertools.count()

    def bump(self) -> None:
        with self.lock:
            self.progress += 1


_activity = _Activity()
_logs: dict[int, OperationLog] = {}
_logs_lock = threading.Lock()
# How far closed communicators got: a rank that leaves reports these too, so that a
# peer still finishing the last operation of a communicator this rank closed is not
# taken for one waiting forever. The newest thousand are kept.
_closed_counts: dict[str, int] = {}
_KEEP_CLOSED = 1000


@contextlib.contextmanager
def waiting(log: OperationLog | None, what: object) -> Iterator[None]:
    """Record that this thread blocks until ``what`` (an operation or message of ``log``) completes."""
    token = next(_activity._tokens)
    with _activity.lock:
        _activity.waits[token] = (None if log is None else log.key, str(what), time.monotonic())
        _activity.progress += 1
    try:
        yield
    finally:
        with _activity.lock:
            del _activity.waits[token]
            _activity.progress += 1


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
        self.last_step: int | None = None
        self._last_start = time.monotonic()
        self._recent: deque[Descriptor] = deque(maxlen=history)
        # Several at once: nested operations (a callback's collective inside another's
        # completion), or gloo/nccl, whose operations overlap. The oldest is reported.
        self._running: dict[int, tuple[Descriptor, float]] = {}
        self._p2p: dict[int, tuple[str, int, int, float]] = {}
        self._p2p_tokens = itertools.count(1)

    def start(self, pending: Descriptor) -> Descriptor:
        """Number ``pending`` as the next operation of this communicator and mark it running."""
        now = time.monotonic()
        with self._lock:
            self.started += 1
            desc = pending._replace(seq=self.started)
            self._running[desc.seq] = (desc, now)
            self._recent.append(desc)
            self._last_start = now
            if desc.step is not None:
                self.last_step = desc.step
        _activity.bump()
        return desc

    def finish(self, desc: Descriptor) -> None:
        """Mark ``desc`` completed (or failed)."""
        with self._lock:
            self._running.pop(desc.seq, None)
        _activity.bump()

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
        _activity.bump()
        return token

    def delivered(self, token: int) -> None:
        """Record that the message of ``token`` completed."""
        with self._lock:
            self._p2p.pop(token, None)
        _activity.bump()

    def running(self) -> tuple[Descriptor | None, float]:
        """Return the oldest running operation and for how many seconds it has run."""
        with self._lock:
            if not self._running:
                return None, 0.0
            desc, since = min(self._running.values(), key=lambda item: item[0].seq)
        return desc, time.monotonic() - since

    def status(self) -> dict:
        """A picklable snapshot for the inspector."""
        now = time.monotonic()
        with self._lock:
            return {
                "members": self.members,
                "started": self.started,
                "running": sorted(((d, now - t) for d, t in self._running.values()), key=lambda item: item[0].seq),
                "p2p": [(kind, peer, tag, now - t) for kind, peer, tag, t in self._p2p.values()],
                "recent": list(self._recent),
                "last_step": self.last_step,
                "idle": now - self._last_start,
            }


def register(log: OperationLog) -> None:
    """Let the stall inspector see ``log`` (until ``unregister``)."""
    with _logs_lock:
        _logs[id(log)] = log


def unregister(log: OperationLog) -> None:
    """Stop showing ``log`` to the stall inspector (its communicator closed)."""
    with _logs_lock:
        if _logs.pop(id(log), None) is not None:
            _closed_counts[log.key] = log.started
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
    """Everything the inspector compares for this rank, as one picklable dict."""
    comms = {log.key: log.status() for log in logs()}
    now = time.monotonic()
    with _activity.lock:
        waits = [(key, what, now - since) for key, what, since in _activity.waits.values()]
        progress = _activity.progress
    return {"rank": rank, "comms": comms, "waits": waits, "progress": progress}
