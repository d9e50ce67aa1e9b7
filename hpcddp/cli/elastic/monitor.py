"""The driver's socket: which ranks of the current start are alive, and how each one ended.

Ranks connect (``hpcddp.elastic.worker``), beat once a second and end with a last word.
A connection that closes without one is a lost rank (its process died: the kernel closes
its sockets at once); one that goes silent is a lost node (cut off, or down).

A connection counts only after its hello carries the driver's token; until then nothing it
sends changes a record. A hello for a rank that has a record in this start already is
refused and its connection closed: the rank's own connection stays the one watched, so
no second process can end it or have it declared lost.

The driver holds one connection per rank: it raises its open-file limit to the hard limit
when it starts (the usual soft limit, 1,024, is below 4,096 ranks), and ``room_for`` says
in one line when a start has more ranks than it can hold.
"""

from __future__ import annotations

import errno
import hmac
import resource
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from ...elastic.protocol import HostUpdate, LineReader, send_message
from ...env.network import list_interfaces
from .log import log

__all__ = ["DriverServer", "RankRecord", "raise_open_file_limit"]

_MAX_HELLO_BYTES = 4096
#: connections that may wait to be accepted (the kernel caps it at net.core.somaxconn)
_BACKLOG = 4096
#: open files the driver needs besides the ranks' connections: its listener, launchers, health checks
RESERVED_FILES = 128


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit; return (soft, hard) after it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):  # macOS refuses an unlimited soft limit: keep what there is
            pass
    return soft, hard


@dataclass
class RankRecord:
    """What the driver knows of one rank of the current start."""

    rank: int
    host: str
    last_seen: float
    ended: str | None = None
    """"done", "restart", "error", or "lost" (closed without a last word); None while running."""
    ended_at: float | None = None
    text: str = ""
    commit: int = -1
    """The newest commit this rank reported (rank 0 reports them)."""


@dataclass
class _Connection:
    peer: str
    reader: LineReader = field(default_factory=LineReader)
    record: RankRecord | None = None


class DriverServer:
    """Accept the ranks' connections and keep their records (a thread of its own).

    Args:
        token: the secret every rank must present.
        loopback_only: listen on 127.0.0.1 only (every rank runs on this host).
    """

    def __init__(self, token: str, loopback_only: bool = False) -> None:
        self._token = token
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1" if loopback_only else "0.0.0.0", 0))
        self.file_limit, self.file_hard_limit = raise_open_file_limit()
        self._listener.listen(_BACKLOG)
        self.port = self._listener.getsockname()[1]
        interfaces = list_interfaces()
        outward = [i.address for i in interfaces if not i.is_loopback]
        self.addresses = ["127.0.0.1"] if loopback_only else [*outward, "127.0.0.1"]
        self._lock = threading.Lock()
        self._launch = 0
        self._records: dict[int, RankRecord] = {}
        self._update: dict | None = None  # the last host update of this start, for ranks that connect later
        self._connections: dict[socket.socket, _Connection] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hpcddp-elastic-driver", daemon=True)
        self._thread.start()

    def begin_launch(self, launch: int) -> None:
        """Forget the ranks of the previous start; only ranks of ``launch`` are taken from now on."""
        with self._lock:
            self._launch = launch
            self._records = {}
            self._update = None

    def room_for(self, num_ranks: int) -> str | None:
        """Return one line saying why ``num_ranks`` connections do not fit under the open-file limit, or None."""
        need = num_ranks + RESERVED_FILES
        if self.file_limit == resource.RLIM_INFINITY or need <= self.file_limit:
            return None
        return (
            f"{num_ranks} ranks need {need} open files in the driver, but its limit is {self.file_limit} "
            f"(hard limit {self.file_hard_limit}): ranks past it go unwatched (a lost one is seen only when the "
            f"job ends); raise the hard limit before hpcddp run (ulimit -Hn {need}, or nofile in limits.conf)"
        )

    def records(self) -> dict[int, RankRecord]:
        """Return a copy of the current start's records, by rank."""
        with self._lock:
            return {rank: RankRecord(**vars(record)) for rank, record in self._records.items()}

    def notify(self, timestamp: float, update: HostUpdate) -> None:
        """Tell every connected rank that the hosts changed, and every rank of this start that connects later."""
        message = {"hosts_updated": timestamp, "update": int(update)}
        with self._lock:
            self._update = message
            targets = [sock for sock, conn in self._connections.items() if conn.record and not conn.record.ended]
        for sock in targets:
            try:
                send_message(sock, message)
            except OSError:
                pass

    def close(self) -> None:
        """Stop serving and close every connection."""
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in list(self._connections):
            sock.close()
        self._listener.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self._listener:
                    self._accept()
                    continue
                try:
                    self._read(key.fileobj)
                except Exception:  # noqa: BLE001 - one connection's garbage must not stop the driver's watch
                    self._drop(key.fileobj)

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                # The listener stays readable while the connection waits: without a pause this
                # thread would spin (room_for has said why already).
                self._stop.wait(0.1)
            return
        sock.setblocking(False)
        self._connections[sock] = _Connection(peer=f"{address[0]}:{address[1]}")
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        conn = self._connections[sock]
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        now = time.monotonic()
        messages = conn.reader.feed(data) if data else []
        greeted = conn.record is None
        with self._lock:
            for message in messages:
                self._take(conn, message, now)
            # A rank still starting when the hosts changed (importing torch: seconds) hears it now;
            # the driver says each change once.
            update = self._update if greeted and conn.record is not None else None
        if update is not None:
            try:
                send_message(sock, update)
            except OSError:
                pass
        if conn.record is not None:
            conn.record.last_seen = now
            if not data and conn.record.ended is None:
                conn.record.ended, conn.record.ended_at = "lost", now
        # A stranger: its first line was not a rank's hello, or it sends a line longer than any hello.
        if not data or (conn.record is None and (messages or len(conn.reader.pending) > _MAX_HELLO_BYTES)):
            self._drop(sock)

    def _take(self, conn: _Connection, message: dict, now: float) -> None:
        if conn.record is None:
            hello = message.get("hello")
            if not isinstance(hello, str) or not hmac.compare_digest(hello.encode(), self._token.encode()):
                return  # a stranger
            if message.get("launch") != self._launch:
                return  # a rank of an earlier start
            try:
                record = RankRecord(rank=int(message["rank"]), host=str(message["host"]), last_seen=now)
            except (KeyError, TypeError, ValueError):
                return
            known = self._records.get(record.rank)
            if known is not None:
                state = "running" if known.ended is None else f"ended ({known.ended})"
                log(
                    f"refused a second hello for rank {record.rank} from {conn.peer} (rank {record.rank} on "
                    f"{known.host} is {state} in start {self._launch}): its first connection stays the one watched"
                )
                return
            conn.record = self._records[record.rank] = record
            return
        if "commit" in message:
            conn.record.commit = max(conn.record.commit, int(message["commit"]))
        for kind in ("done", "restart", "error"):
            if kind in message and conn.record.ended is None:
                conn.record.ended, conn.record.ended_at = kind, now
                conn.record.text = "" if message[kind] == 1 else str(message[kind])

    def _drop(self, sock: socket.socket) -> None:
        self._connections.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
