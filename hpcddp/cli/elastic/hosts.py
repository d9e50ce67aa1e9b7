"""Which hosts an elastic job may use: a fixed list or a discovery script, less the hosts that failed.

A host whose ranks failed is blacklisted, as Horovod's driver does, and taken back when
it works again: when it passes the launcher's health check, tried 10 s after its failure
and then at doubling intervals up to 5 min (Horovod's blacklist cooldown, so that a
host that keeps failing costs ever fewer restarts), or, with a discovery script, when the
script has stopped listing it and lists it again (the node went away and returned).
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ...env.network import list_interfaces
from ...env.slurm import expand_nodelist, expand_tasks_per_node

__all__ = ["Host", "HostPool", "is_this_host", "parse_host_lines", "parse_hosts", "read_hostfile", "slurm_hosts"]

_DISCOVERY_TIMEOUT_S = 30.0
#: seconds a host's name may take to resolve when the driver asks whether it is this host
_RESOLVE_TIMEOUT_S = 2.0
#: first wait before a failed host is checked again, and the longest
RECHECK_FIRST_S, RECHECK_MAX_S = 10.0, 300.0


@dataclass(frozen=True)
class Host:
    """A host and the ranks it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _host(item: str, what: str, default_slots: int | None) -> Host:
    name, sep, slots = item.strip().partition(":")
    if not sep:
        if default_slots is None:
            raise ValueError(f"{what}: {item!r} names no slots: write host:slots, e.g. {name}:2")
        return Host(name, default_slots)
    if not name or not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"{what}: {item!r} is not host:slots with slots >= 1, e.g. node1:2")
    return Host(name, int(slots))


def parse_hosts(spec: str) -> list[Host]:
    """Parse mpirun's ``-H node1:2,node2:2`` (a host without slots has 1)."""
    return [_host(item, "-H/--hosts", 1) for item in spec.split(",") if item.strip()]


def parse_host_lines(text: str, what: str = "the host discovery script") -> list[Host]:
    """Parse ``host:slots`` lines (Horovod's discovery format); blank lines and # comments are skipped."""
    hosts = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(_host(line, what, None))
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Read an Open MPI hostfile (``node1 slots=2`` lines; a host without slots has 1)."""
    hosts = []
    with open(path) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            slots = 1
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key == "slots" and value.isdigit():
                    slots = int(value)
            hosts.append(Host(words[0], slots))
    return hosts


def slurm_hosts(environ: Mapping[str, str]) -> list[Host]:
    """Return the nodes of this Slurm allocation with their tasks (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE)."""
    names = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "")
    counts = expand_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", ""))
    if not names or len(counts) != len(names):
        raise ValueError(
            "cannot tell the allocation's nodes and tasks from SLURM_JOB_NODELIST/SLURM_TASKS_PER_NODE: "
            "give -H or --hostfile"
        )
    return [Host(name, count) for name, count in zip(names, counts)]


def is_this_host(name: str, timeout: float = _RESOLVE_TIMEOUT_S) -> bool:
    """Return True when ``name`` is certainly this host; False when it may be another.

    This host is: ``localhost`` or a loopback address; one of its own addresses; its own
    name (its short name only when ``name`` has no dot: ``node1`` is ``node1.cluster.org``,
    but ``node1.other-cluster.org`` is another host); its fully qualified name; or a name
    that resolves within ``timeout`` seconds to loopback or its own addresses alone. A
    name that does not resolve, or not in time, may be another host.

    Args:
        name: a host as -H, a hostfile or Slurm names it.
        timeout: seconds the name's lookup may take.
    """
    name = name.strip().lower()
    own_addresses = {i.address for i in list_interfaces()}
    try:
        address = ipaddress.ip_address(name)
    except ValueError:  # a name, not an address
        pass
    else:
        return address.is_loopback or str(address) in own_addresses
    own = socket.gethostname().lower()
    if name in ("localhost", own) or ("." not in name and name == own.split(".")[0]):
        return True
    found = _lookup(name, timeout)
    if found is None:
        return False
    fqdn, addresses = found
    if name == fqdn:
        return True
    return bool(addresses) and all(a.is_loopback or str(a) in own_addresses for a in addresses)


def _lookup(name: str, timeout: float) -> tuple[str, set] | None:
    """Return (this host's fully qualified name, ``name``'s addresses), or None when it takes past ``timeout``.

    The lookup runs in a thread of its own: a resolver waiting on a DNS server that does not
    answer blocks for as long as it is configured to (30 s and more), and the driver must start.
    """
    result: list[tuple[str, set]] = []

    def look() -> None:
        fqdn = socket.getfqdn().lower()
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):  # no such name here
            infos = []
        result.append((fqdn, {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}))

    thread = threading.Thread(target=look, name="hpcddp-elastic-lookup", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else None


class HostPool:
    """The hosts an elastic job may use now.

    Args:
        hosts: a fixed list, or None with ``discovery_script``.
        discovery_script: a program that prints the hosts available now, one ``host:slots`` a line.
    """

    def __init__(self, hosts: Sequence[Host] | None = None, discovery_script: str | None = None) -> None:
        if (hosts is None) == (discovery_script is None):
            raise ValueError("give the hosts (-H/--hostfile) or --host-discovery-script, one of the two")
        self._fixed = list(hosts) if hosts is not None else None
        self._script = discovery_script
        self.blacklist: set[str] = set()
        self._listed: set[str] | None = None
        self._failures: dict[str, int] = {}
        self._recheck_at: dict[str, float] = {}
        # The driver's loop and its host watch (a thread) both use the pool.
        self._lock = threading.Lock()

    def is_local(self) -> bool:
        """Return True when every host the job may use is this host (a discovery script may list any)."""
        return self._fixed is not None and all(is_this_host(host.name) for host in self._fixed)

    def discover(self) -> list[Host]:
        """Return the hosts that may be used now, in the order listed, without blacklisted ones."""
        listed = self._fixed if self._fixed is not None else self._run_script()
        with self._lock:
            if self._fixed is None:
                names = {host.name for host in listed}
                # A blacklisted host that the script dropped and lists again has come back.
                if self._listed is not None:
                    self.blacklist -= names - self._listed
                self._listed = names
            return [host for host in listed if host.name not in self.blacklist]

    def fail(self, names: Sequence[str]) -> None:
        """Blacklist hosts whose ranks failed; each is checked again after its cooldown."""
        now = time.monotonic()
        with self._lock:
            for name in names:
                self.blacklist.add(name)
                self._failures[name] = self._failures.get(name, 0) + 1
                wait = min(RECHECK_MAX_S, RECHECK_FIRST_S * 2 ** (self._failures[name] - 1))
                self._recheck_at[name] = now + wait

    def due_for_recheck(self) -> list[str]:
        """Return the blacklisted hosts whose cooldown is over (the driver health-checks them)."""
        now = time.monotonic()
        with self._lock:
            return sorted(name for name in self.blacklist if self._recheck_at.get(name, 0.0) <= now)

    def recheck(self, failed_hosts: Callable[[list[str]], set[str]]) -> list[str]:
        """Health-check the hosts due (``failed_hosts(names)`` names those that fail); return those taken back."""
        due = self.due_for_recheck()
        if not due:
            return []
        failed = failed_hosts(due)
        healthy = [name for name in due if name not in failed]
        self.rechecked(healthy, sorted(failed))
        return healthy

    def rechecked(self, healthy: Sequence[str], failed: Sequence[str]) -> None:
        """Take back hosts that passed the check; wait longer before checking the others again."""
        now = time.monotonic()
        with self._lock:
            self.blacklist.difference_update(healthy)
            for name in failed:
                wait = min(RECHECK_MAX_S, RECHECK_FIRST_S * 2 ** self._failures.get(name, 1))
                self._recheck_at[name] = now + wait

    def _run_script(self) -> list[Host]:
        try:
            done = subprocess.run(
                [self._script], capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RuntimeError(f"--host-discovery-script {self._script} failed: {err}") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"--host-discovery-script {self._script} exited {done.returncode}: {done.stderr.strip()[-300:]}"
            )
        return parse_host_lines(done.stdout, f"--host-discovery-script {self._script}")
