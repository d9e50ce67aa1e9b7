"""Stop signals that arrive before a ``PreemptionHandler`` is entered: held for it, for a while.

Between ``hpcddp.init()`` and the training loop a script loads data and builds its model
(seconds; minutes at thousands of ranks). A SIGUSR1 or SIGTERM then (``scancel --signal``,
Slurm's preemption and time limit) would kill the ranks by the signal's default action, and
Slurm marks the job FAILED instead of letting the handler checkpoint and requeue it. So from
``init()`` on (from interpreter start under ``hpcddp run`` and ``slurm/train.sh``, whose
``sitecustomize`` loads this module alone: it imports nothing of hpcddp, nor torch) a stop
signal whose handler is still the default one is held:

- the next ``PreemptionHandler`` entered takes it: its first ``should_stop()`` is True on
  every rank, and the script checkpoints and requeues as for a signal in the loop;
- a script that enters none within ``HPCDDP_STOP_WAIT`` seconds (default 25, below Slurm's
  default KillWait) is ended by the
  signal's default action, as without hpcddp, only later: a SIGTERM to a job without a
  handler still ends it (Slurm's own SIGKILL follows SIGTERM after its KillWait, 30 s by
  default, whichever comes first);
- a script that ends before then, or installs a handler of its own, or gets a second stop
  signal, ends by the signal then (or its own handler gets it).

The handler runs on the main thread between bytecodes: a rank blocked in a long C call (a
collective) acts on a held signal only when the call returns; SIGKILL (Slurm's, after
KillWait) still ends it.

``HPCDDP_STOP_WAIT=0`` holds nothing (the default action at once, as before). A handler that
the script or a framework installed is never replaced, a child forked from a rank gets the
default handlers back (it is not a rank), and the first ``PreemptionHandler`` ends the holding
for good: after it, a stop signal does what its handler says, as without hpcddp.

The holder is the installed signal handler itself (``signal.getsignal``): the copy of this
module that ``sitecustomize`` loaded and the one ``hpcddp.fault.stop_signals`` imports find
each other's through it, and share no module state.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable

__all__ = ["STOP_SIGNALS", "hold_stop_signals", "release_held_signals", "take_held_signal"]

log = logging.getLogger("hpcddp")

#: the signals a PreemptionHandler catches by default, held until one is entered
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class _Holder:
    """The signal handler that holds the first stop signal for a ``PreemptionHandler``.

    It runs between any two bytecodes of the main thread, so it only records and starts a
    thread (``_thread``, which takes no lock the interrupted code may hold); that thread
    says so and, once ``wait_s`` has passed untaken, sends the signal again, whose delivery
    here then ends the process by the default action.
    """

    holds_stop_signals = True  # what take_held_signal looks for (a copy of this module has its own class)

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.signals: set[int] = set()  # the signals this holder is installed for
        self.received = 0  # the held signal (0: none yet)
        self.received_at = 0.0
        self.taken = False

    def __call__(self, signum, frame) -> None:
        if self.received and not self.taken:
            # A second stop signal while one is held (or the wait is over): the sender means it.
            self._end_by(signum)
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()
            _thread.start_new_thread(self._end_unless_taken, ())

    def _end_by(self, signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _end_unless_taken(self) -> None:
        name = signal.Signals(self.received).name
        log.warning(
            "hpcddp: %s before any PreemptionHandler was entered: held for the next one (its first should_stop() "
            "is True), for at most %g s (HPCDDP_STOP_WAIT), then this process ends as %s would end it",
            name,
            self.wait_s,
            name,
        )
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and not self.taken:
            if signal.getsignal(self.received) is not self:
                # The script installed a handler of its own since: it gets the signal now.
                self.taken = True
                os.kill(os.getpid(), self.received)
                return
            time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))
        if self.taken:
            return
        log.warning(
            "hpcddp: no PreemptionHandler took %s within %g s (HPCDDP_STOP_WAIT): ending as %s does",
            name,
            self.wait_s,
            name,
        )
        os.kill(os.getpid(), self.received)

    def take(self) -> int:
        """Return the held signal (0: none) and stop holding: a PreemptionHandler has it now."""
        self.taken = True
        return self.received

    def at_exit(self) -> None:
        if self.received and not self.taken:
            name = signal.Signals(self.received).name
            log.warning(
                "hpcddp: %s was held for a PreemptionHandler that was never entered; the script ended first, "
                "and ends now as %s would end it",
                name,
                name,
            )
            # The launcher and Slurm then see the death by the signal they sent, not a success.
            self.taken = True
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            self._end_by(self.received)


def _holder() -> _Holder | None:
    """The holder installed for any stop signal now, or None."""
    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if getattr(handler, "holds_stop_signals", False):
            return handler
    return None


def hold_stop_signals(wait_s: float) -> None:
    """Hold SIGUSR1 and SIGTERM for the next ``PreemptionHandler``, where their handler is the default one.

    Does nothing off the main thread (Python runs signal handlers there only), with
    ``wait_s`` 0, where a holder is installed already, and for a signal the script or a
    framework gave a handler of its own (from Python, or from C as ``faulthandler.register``).

    Args:
        wait_s: seconds a held signal waits for a PreemptionHandler before it ends the process.
    """
    if wait_s <= 0 or threading.current_thread() is not threading.main_thread() or _holder() is not None:
        return
    holder = _Holder(wait_s)
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL and not _handled_outside_python(signum):
            signal.signal(signum, holder)
            holder.signals.add(signum)
    if holder.signals:
        atexit.register(holder.at_exit)
        if not _fork_hook:
            os.register_at_fork(after_in_child=_release_in_child)
            _fork_hook.append(True)


_fork_hook: list[bool] = []  # registered once per process (os.register_at_fork has no way back)


def _handled_outside_python(signum: int) -> bool:
    """True when the process's handler for ``signum`` is not the default, though Python's record says it is.

    A handler installed from C after Python started, as ``faulthandler.register(SIGUSR1)``
    does, is not in the table ``signal.getsignal`` reads; only sigaction(2) shows it.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(512)  # struct sigaction, its handler first on every libc
        if libc.sigaction(signum, None, action) != 0:
            return False
        return ctypes.c_void_p.from_buffer(action).value not in (None, 0)  # 0: SIG_DFL
    except (OSError, AttributeError):  # no libc to ask: Python's record is all there is
        return False


def _release_in_child() -> None:
    holder = _holder()
    if holder is not None:
        holder.taken = True  # a thread holding for the parent does not run here; none starts either
        _restore_defaults(holder)


def _restore_defaults(holder: _Holder, keep: Iterable[int] = ()) -> None:
    for signum in holder.signals - set(keep):
        if signal.getsignal(signum) is holder:
            signal.signal(signum, signal.SIG_DFL)


def take_held_signal(previous: dict[int, object]) -> int:
    """For a PreemptionHandler just installed over ``previous``: return the held signal it now owns (0: none).

    The holding ends for good: ``previous`` gets the default handler where it named the
    holder, and the holder's other signals get theirs back. A held signal the
    PreemptionHandler does not catch is not taken: it ends the process when its wait is over.

    Args:
        previous: signal number -> the handler the PreemptionHandler replaced (updated in place).
    """
    holder = next((h for h in previous.values() if getattr(h, "holds_stop_signals", False)), None) or _holder()
    if holder is None:
        return 0
    for signum, handler in previous.items():
        if handler is holder:
            previous[signum] = signal.SIG_DFL
    _restore_defaults(holder, keep=previous)
    if holder.received in previous:
        return holder.take()
    return 0


def release_held_signals() -> None:
    """Give SIGUSR1 and SIGTERM their default handlers back unless a signal is held (``hpcddp.shutdown()``).

    A held signal keeps its holder: it still ends the process when its wait is over.
    """
    holder = _holder()
    if holder is not None and not holder.received and threading.current_thread() is threading.main_thread():
        _restore_defaults(holder)
