"""Profiler events for the backend's operations, as gloo and NCCL record theirs.

Under ``torch.profiler`` or the autograd profiler each collective and message shows as
one event named ``<backend>:<op>`` (``mpi:all_reduce``, ``mpi:send``) with its input
shapes, spanning the call to the operation's completion. torch marks an event
asynchronous when it ends on another thread than the one that began it; a backend's
operations are asynchronous (they run on the communication thread), so their events
end on one thread of their own, which watches the operations in flight: a blocking
call that the calling thread runs itself still reads as the same kind of event.

Nothing is recorded, and nothing started, while no profiler is on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

__all__ = ["begin", "end_when_done"]

_FIRST_GAP_S, _LONGEST_GAP_S = 20e-6, 1e-3


def begin(name: str, inputs: Sequence[torch.Tensor]):
    """Start the event ``name`` of an operation on ``inputs``; None while no profiler is on."""
    if not torch.autograd._profiler_enabled():
        return None
    event = torch._C._profiler._RecordFunctionFast(name, input_values=list(inputs))
    event.__enter__()
    return event


def end_when_done(event, handle):
    """End ``event`` (from ``begin``) when ``handle`` (an engine handle or a message) completes; return ``handle``."""
    if event is not None:
        _closer().watch(handle, event)
    return handle


class _EventCloser:
    """Ends each event when its operation completes, on a thread of its own."""

    def __init__(self) -> None:
        self._pending: list = []
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hpcddp-profiler-events", daemon=True)
        self._thread.start()

    def watch(self, handle, event) -> None:
        with self._lock:
            self._pending.append((handle, event))
            self._lock.notify()

    def _run(self) -> None:
        gap = _FIRST_GAP_S
        while True:
            with self._lock:
                while not self._pending:
                    self._lock.wait()
                pending = list(self._pending)
            finished = [(handle, event) for handle, event in pending if handle.poll()]
            for _, event in finished:
                event.__exit__(None, None, None)
            if finished:
                with self._lock:
                    self._pending = [item for item in self._pending if item not in finished]
                gap = _FIRST_GAP_S
            else:
                time.sleep(gap)
                gap = min(2 * gap, _LONGEST_GAP_S)


_instance: _EventCloser | None = None
_instance_lock = threading.Lock()


def _closer() -> _EventCloser:
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = _EventCloser()
        return _instance
