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
calling thread ran itself (``end``) ends its event elsewhere, as gloo's do. A Work's ``wait()``
returns only once its event ended (``wait_ended``), as gloo's Work ends its event before
it completes: a profiler stopped right after the wait has the event (without this, a
loaded machine's ending thread lost that race now and then).

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

__all__ = ["begin", "end", "end_when_done", "wait_ended"]


def begin(name: str, inputs: Sequence[torch.Tensor]) -> _Event | None:
    """Start the event ``name`` of an operation on ``inputs``; ``end_when_done`` ends it.

    Returns None while no profiler is on.
    """
    if not torch.autograd._profiler_enabled() or _ready() is None:
        return None
    record = torch._C._autograd._record_function_with_args_enter(name, *inputs)
    end = torch.futures.Future()
    torch.ops.profiler._call_end_callbacks_on_jit_fut(record, end)
    event = _Event(end, _session)
    with _stopping:
        _unended.add(event)  # freed only once ended: also an operation that never completes keeps it
    return event


def end_when_done(event: _Event | None, handle):
    """End ``event`` (from ``begin``) when ``handle`` (an engine handle or a message) completes; return ``handle``."""
    if event is not None:
        handle.on_completion(lambda: _events.put(event))
    return handle


def end(event: _Event | None) -> None:
    """End ``event`` (from ``begin``): its operation completed in this thread. None: do nothing."""
    if event is not None:
        _events.put(event)


def wait_ended(event: _Event | None) -> None:
    """Block until ``event`` (from ``begin``) ended, or its profiler stopped first; None: return at once."""
    if event is not None:
        event.settled.wait()


class _Event:
    __slots__ = ("end", "session", "settled")

    def __init__(self, end: torch.futures.Future, session: int) -> None:
        self.end, self.session = end, session
        self.settled = threading.Event()  # set by the ending thread, whether it ended the event or not


_session = 0  # how many times a profiler stopped
_stopping = threading.Lock()  # a profiler stops, or an event ends: never both at once
_unended: set[_Event] = set()  # begun and not ended: those of a stopped profiler stay for good
_events: queue.SimpleQueue | None = None  # completed operations' events, for the ending thread
_setup_lock = threading.Lock()


def _ready() -> queue.SimpleQueue | None:
    """Once: wrap torch's ``_disable_profiler`` so that a stop starts a new session, and start the
    thread that ends events. None when this torch has no ``_disable_profiler`` (then no events)."""
    global _events
    with _setup_lock:
        if _events is None:
            from torch.autograd import profiler

            disable = getattr(profiler, "_disable_profiler", None)
            if disable is None:
                return None

            def disable_between_event_ends(*args, **kwargs):
                global _session
                with _stopping:
                    _session += 1
                    return disable(*args, **kwargs)

            profiler._disable_profiler = disable_between_event_ends
            _events = queue.SimpleQueue()
            threading.Thread(target=_end_events, args=(_events,), name="hpcddp-profiler-events", daemon=True).start()
        return _events


def _end_events(events: queue.SimpleQueue) -> None:
    while True:
        event = events.get()
        with _stopping:
            if event.session == _session:
                _unended.discard(event)
                event.end.set_result(None)
        event.settled.set()
