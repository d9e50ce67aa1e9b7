"""What the elastic driver watches while a start runs: the hosts, and the ranks' silence.

``HostWatch`` looks at the hosts once a second in a thread of its own (a discovery script
may hang, a health check takes seconds) and tells the driver what changed; the driver's
loop never waits for it.
"""

from __future__ import annotations

import threading
import time

from ...elastic.protocol import HostUpdate
from .hosts import HostPool
from .launchers import JobLauncher
from .log import log
from .monitor import RankRecord

__all__ = ["HostWatch", "describe", "silent_hosts"]

_INTERVAL_S = 1.0


class HostWatch:
    """Compare the hosts available with those of the current start, and take back healed hosts.

    Args:
        pool: the hosts (thread-safe).
        used: the hosts of the current start.
        max_np: the most ranks the job may have (None: no limit).
        launcher: runs the health checks.
    """

    def __init__(self, pool: HostPool, used: set[str], max_np: int | None, launcher: JobLauncher) -> None:
        self._pool, self._used, self._max_np, self._launcher = pool, used, max_np, launcher
        self._next = time.monotonic() + _INTERVAL_S
        self._told = HostUpdate.no_update
        self._look: threading.Thread | None = None
        self._seen: dict[str, int] | None = None
        self._error: str | None = None

    def poll(self) -> HostUpdate:
        """Return what changed since the last report (no_update most of the time); never blocks."""
        if self._look is not None and self._look.is_alive():
            return HostUpdate.no_update
        update = HostUpdate.no_update
        if self._look is not None:
            self._look = None
            update = self._compare()
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + _INTERVAL_S
            self._look = threading.Thread(target=self._run, name="hpcddp-elastic-hosts", daemon=True)
            self._look.start()
        return update

    def _run(self) -> None:
        healthy = self._pool.recheck(self._launcher.failed_hosts)
        if healthy:
            log(f"{', '.join(healthy)} pass(es) the health check again: taken back")
        try:
            self._seen, self._error = {h.name: h.slots for h in self._pool.discover()}, None
        except (RuntimeError, ValueError) as err:  # fails, hangs, or prints garbage: nothing changed
            self._seen, self._error = None, str(err)

    def _compare(self) -> HostUpdate:
        if self._seen is None:
            log(f"{self._error} (the hosts stay as they are)")
            return HostUpdate.no_update
        available = self._seen
        update = HostUpdate.no_update
        if self._used - set(available):
            update |= HostUpdate.removed
        used_slots = sum(available.get(name, 0) for name in self._used)
        room = self._max_np is None or used_slots < self._max_np
        if set(available) - self._used and room:
            update |= HostUpdate.added
        if update == self._told:
            return HostUpdate.no_update
        self._told = update
        if update:
            log(f"hosts changed ({update.name}): the ranks start again at their next commit")
        return update


def silent_hosts(records: dict[int, RankRecord], timeout: float) -> set[str]:
    """Return the hosts all of whose running ranks have been silent for ``timeout`` seconds."""
    now = time.monotonic()
    by_host: dict[str, list[RankRecord]] = {}
    for record in records.values():
        by_host.setdefault(record.host, []).append(record)
    return {
        host for host, ranks in by_host.items() if all(r.ended is None and now - r.last_seen > timeout for r in ranks)
    }


def describe(records: dict[int, RankRecord], *kinds) -> str:
    """Name the ranks whose end is one of ``kinds`` (None: still running): ``"2 on vnode2, ..."``."""
    return ", ".join(
        f"{r.rank} on {r.host}" for r in sorted(records.values(), key=lambda r: r.rank) if r.ended in kinds
    )
