"""Simulated hosts for the elastic driver's health checks: hundreds of them, in one process.

A real check is a launcher process on the driver's host, and hundreds of them share its
few cores: each takes longer the more run at once. ``FakeHosts`` models that as processor
sharing (``capacity`` checks run at full speed; beyond that each runs at
``capacity / running``), and its checks behave as ``subprocess.Popen`` enough for
``JobLauncher`` (``poll``, ``wait``, ``kill``). Pass ``stop=FakeHosts.stop`` where the
launcher would signal a process group.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterable

__all__ = ["FakeCheck", "FakeHosts"]


class FakeCheck:
    """One simulated health check: a Popen look-alike."""

    def __init__(self, hosts: FakeHosts, host: str, work_s: float | None, code: int) -> None:
        self._hosts = hosts
        self.host = host
        self.remaining_s = work_s  # None: the host hangs, the check never ends
        self.code = code
        self.returncode: int | None = None
        self.pid = -1

    def poll(self) -> int | None:
        """Return the exit code once the check has ended, else None."""
        self._hosts.advance()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end of the check, at most ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("fake health check", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        """End the check at once (exit code -9)."""
        with self._hosts.lock:
            if self.returncode is None:
                self.returncode = -9
                self._hosts.running.discard(self)


class FakeHosts:
    """Hosts whose checks share ``capacity`` cores of the driver's host.

    Args:
        work_s: CPU seconds one check needs (a launcher starting, reaching the host, running ``true``).
        capacity: checks that run at full speed at once.
        bad: hosts whose check ends with exit code 1.
        hung: hosts whose check never ends.
    """

    def __init__(self, work_s: float, capacity: int, bad: Iterable[str] = (), hung: Iterable[str] = ()) -> None:
        self.work_s, self.capacity = work_s, capacity
        self.bad, self.hung = set(bad), set(hung)
        self.running: set[FakeCheck] = set()
        self.started = 0
        self.most_at_once = 0
        self.lock = threading.Lock()
        self._last = time.monotonic()

    def start(self, host: str) -> FakeCheck:
        """Start the check of ``host`` (``JobLauncher._start_check``'s stand-in)."""
        self.advance()
        check = FakeCheck(self, host, None if host in self.hung else self.work_s, 1 if host in self.bad else 0)
        with self.lock:
            self.started += 1
            if check.remaining_s is not None:
                self.running.add(check)
            self.most_at_once = max(self.most_at_once, len(self.running))
        return check

    def advance(self) -> None:
        """Move every running check on by the time since the last look, sharing the capacity."""
        with self.lock:
            now = time.monotonic()
            elapsed, self._last = now - self._last, now
            if not self.running:
                return
            speed = min(1.0, self.capacity / len(self.running))
            for check in list(self.running):
                check.remaining_s -= elapsed * speed
                if check.remaining_s <= 0:
                    check.returncode = check.code
                    self.running.discard(check)

    @staticmethod
    def stop(proc, environ=None, grace_s: float = 0.0, cwd=None) -> None:
        """``stop_launcher``'s stand-in: kill the fake check."""
        proc.kill()
