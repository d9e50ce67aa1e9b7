"""Profiler events for the backend's operations, as gloo and NCCL record theirs.

Under ``torch.profiler`` or the autograd profiler each collective and message shows as
one event named ``<backend>:<op>`` (``mpi:all_reduce``, ``mpi:send``) with its input
shapes, from the call to the operation's completion, marked asynchronous as torch marks
gloo's (it ended on another thread than the one that began it).

An event ends on another thread only if that thread carries the profiler's
thread-local state: torch's ``_call_end_callbacks_on_jit_fut`` ends it from a future's
callback with the state of the thread that began it (ending it from a plain Python
thread leaves it open until the profiler stops). The operation's completion hands that
future to one thread of this module, which completes it: also a blocking call that the
calling thread ran itself ends its event elsewhere, as gloo's do.

An event still open when its profiler stops is never ended nor released (ending or
freeing it after ``_disable_profiler`` crashes torch 2.13 in its event collection): the
stop waits for events being ended, and the ones left are kept for the life of the
process (one small object per operation that was in flight at that moment).

Nothing is recorded, and no thread started, while no profiler is on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

__all__ = ["begin", "end_when_done"]


def begin(name: str, inputs: Sequence[torch.Tensor]) -> _Event | None:
    """Start the event ``name`` of an operation on ``inputs``; ``end_when_done`` ends it.

    Returns None while no profiler is on.
    """
    if not torch.autograd._profiler_enabled() or not _watch_profiler_stops():
        return None
    record = torch._C._autograd._record_function_with_args_enter(name, *inputs)
    end = torch.futures.Future()
    torch.ops.profiler._call_end_callbacks_on_jit_fut(record, end)
    event = _Event(end, _session)
    with _stopping:
        _open.add(event)  # freed only once ended: also an operation that never completes keeps it
    return event


def end_when_done(event: _Event | None, handle):
    """End ``event`` (from ``begin``) when ``handle`` (an engine handle or a message) completes; return ``handle``."""
    if event is not None:
        handle.on_completion(lambda: _ender().put(event))
    return handle


class _Event:
    __slots__ = ("end", "session")

    def __init__(self, end: torch.futures.Future, session: int) -> None:
        self.end, self.session = end, session


_session = 0  # how many times a profiler stopped
_stopping = threading.Lock()  # a profiler stops, or an event ends: never both at once
_open: set[_Event] = set()  # begun, not yet ended
_kept: list[_Event] = []  # open when their profiler stopped
_watching = None


def _watch_profiler_stops() -> bool:
    """Wrap torch's ``_disable_profiler`` (once) so that a stop starts a new session; False if it cannot."""
    global _watching
    if _watching is None:
        from torch.autograd import profiler

        disable = getattr(profiler, "_disable_profiler", None)
        _watching = disable is not None
        if _watching:

            def disable_after_ending_events(*args, **kwargs):
                global _session
                with _stopping:
                    _session += 1
                    return disable(*args, **kwargs)

            profiler._disable_profiler = disable_after_ending_events
    return _watching


def _end_events(events: queue.SimpleQueue) -> None:
    while True:
        event = events.get()
        with _stopping:
            _open.discard(event)
            if event.session == _session:
                event.end.set_result(None)
            else:
                _kept.append(event)


_events: queue.SimpleQueue | None = None
_lock = threading.Lock()


def _ender() -> queue.SimpleQueue:
    global _events
    with _lock:
        if _events is None:
            _events = queue.SimpleQueue()
            threading.Thread(target=_end_events, args=(_events,), name="hpcddp-profiler-events", daemon=True).start()
        return _events
