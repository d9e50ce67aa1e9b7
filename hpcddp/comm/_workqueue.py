"""The mpi backend's work queue: collectives in submission order, run by one thread at a time."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from .base import Handle

__all__ = ["QueuedHandle", "WorkQueue"]


class WorkQueue:
    """Collectives in submission order, run by one thread at a time.

    The communication thread takes items with ``get``; a thread about to wait for a
    handle may ``steal`` the next item instead and run it itself, which spares the
    wake-up of the communication thread (tens of microseconds per collective, far
    more on a loaded host) whenever that thread has not started the work yet.
    """

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._busy = False

    def put(self, item, wake: bool = True) -> None:
        """Queue ``item``; with ``wake=False`` the caller promises to wait for it (and so run it)."""
        with self._ready:
            self._items.append(item)
            # Every needless wake-up preempts a rank spinning in a collective on a
            # busy host; release() wakes the thread when the runner finishes.
            if wake and not self._busy:
                self._ready.notify()

    def get(self):
        """Block until an item is next and nobody runs one; the caller must ``release``."""
        with self._ready:
            while self._busy or not self._items:
                self._ready.wait()
            item = self._items.popleft()
            self._busy = item is not None
            return item

    def claim(self) -> bool:
        """Become the runner if nothing is queued and nobody runs; the caller must ``release``."""
        with self._ready:
            if self._busy or self._items:
                return False
            self._busy = True
            return True

    def steal(self):
        """Return the next item if nobody runs one (the caller must ``release``), else None."""
        with self._ready:
            if self._busy or not self._items or self._items[0] is None:
                return None
            self._busy = True
            return self._items.popleft()

    def release(self) -> None:
        with self._ready:
            self._busy = False
            if self._items:
                self._ready.notify()


class QueuedHandle(Handle):
    """A Handle whose waiter runs queued collectives itself rather than sleep."""

    def __init__(self, name: str, help_until: Callable[[Handle], None]) -> None:
        super().__init__(name)
        self._help_until = help_until

    def _block(self, timeout: float | None) -> bool:
        if not self._done.is_set():
            self._help_until(self)
        return self._done.wait(timeout)
