"""The driver's socket: which ranks of the current start are alive, and how each one ended.

Ranks connect (``hpcddp.elastic.worker``), beat once a second and end with a last word.
A connection that closes without one is a lost rank (its process died: the kernel closes
its sockets at once); one that goes silent is a lost node (cut off, or down).

A connection counts only after its first line is a hello that carries the driver's token
and names a rank of the current start: ``launch`` is this start's number, ``size`` its
number of ranks, ``rank`` an int below it (JSON ints only: no ``true``, ``3.9`` or ``"7"``).
Until then nothing it sends changes a record. A hello for a rank that has a record in this
start already is refused: the rank's own connection stays the one watched, so no second
process can end it or have it declared lost. A refused connection hears why
(``{"refused": why}``, which the rank logs) and is closed; the driver logs one line only
when the hello carried the token (a port scan fills no log).

Connections that have not said hello cost the driver an open file each, so none waits
longer than ``HELLO_TIMEOUT_S`` and at most ``max_waiting`` wait at once: past that the
one that has waited longest is closed (a rank sends its hello as soon as it connects).

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

from ...elastic.protocol import HostUpdate, LineReader, parse_message, send_message
from ...env.network import list_interfaces
from .log import log

__all__ = ["HELLO_TIMEOUT_S", "MAX_WAITING", "DriverServer", "RankRecord", "raise_open_file_limit"]

_MAX_HELLO_BYTES = 4096
#: seconds a connection may stay open without a hello before the driver closes it
HELLO_TIMEOUT_S = 10.0
#: connections waiting for their hello at once, at most (fewer under a low open-file limit)
MAX_WAITING = 256
#: longest piece of a refused hello that a log line or a reply quotes
_QUOTED_CHARS = 40
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
    opened: float
    reader: LineReader = field(default_factory=LineReader)
    record: RankRecord | None = None


def _quoted(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."


class DriverServer:
    """Accept the ranks' connections and keep their records (a thread of its own).

    Args:
        token: the secret every rank must present.
        loopback_only: listen on 127.0.0.1 only (every rank runs on this host).
    """

    def __init__(self, token: str, loopback_only: bool = False) -> None:
        self._token = token.encode()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1" if loopback_only else "0.0.0.0", 0))
        self.file_limit, self.file_hard_limit = raise_open_file_limit()
        # An eighth of a low limit: waiting strangers must leave room for the ranks and health checks.
        unlimited = self.file_limit == resource.RLIM_INFINITY
        self.max_waiting = MAX_WAITING if unlimited else max(8, min(MAX_WAITING, self.file_limit // 8))
        self._listener.listen(_BACKLOG)
        self.port = self._listener.getsockname()[1]
        interfaces = list_interfaces()
        outward = [i.address for i in interfaces if not i.is_loopback]
        self.addresses = ["127.0.0.1"] if loopback_only else [*outward, "127.0.0.1"]
        # Guards the records, the start and its update, and the connections (notify reads them).
        self._lock = threading.Lock()
        self._launch = 0
        self._num_proc = 0
        self._records: dict[int, RankRecord] = {}
        self._update: dict | None = None  # the last host update of this start, for ranks that connect later
        self._connections: dict[socket.socket, _Connection] = {}
        # The connections without a hello yet, oldest first (the server's thread alone uses it).
        self._waiting: dict[socket.socket, float] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hpcddp-elastic-driver", daemon=True)
        self._thread.start()

    def begin_launch(self, launch: int, num_proc: int) -> None:
        """Forget the ranks of the previous start; only the ranks 0..num_proc-1 of ``launch`` are taken from now on.

        Args:
            launch: the start's number (``HPCDDP_ELASTIC_LAUNCH``).
            num_proc: its number of ranks.
        """
        with self._lock:
            self._launch = launch
            self._num_proc = num_proc
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
                    self._lose(key.fileobj)
            self._close_late_hellos()

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                # The listener stays readable while the connection waits: without a pause this
                # thread would spin (room_for has said why already).
                self._stop.wait(0.1)
            return
        if len(self._waiting) >= self.max_waiting:
            self._refuse(next(iter(self._waiting)), f"more than {self.max_waiting} connections wait for a hello")
        now = time.monotonic()
        sock.setblocking(False)
        with self._lock:
            self._connections[sock] = _Connection(peer=f"{address[0]}:{address[1]}", opened=now)
        self._waiting[sock] = now
        self._selector.register(sock, selectors.EVENT_READ)

    def _close_late_hellos(self) -> None:
        deadline = time.monotonic() - HELLO_TIMEOUT_S
        while self._waiting:
            sock, opened = next(iter(self._waiting.items()))
            if opened > deadline:
                return
            self._refuse(sock, f"no hello within {HELLO_TIMEOUT_S:g} s")

    def _read(self, sock: socket.socket) -> None:
        conn = self._connections[sock]
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        now = time.monotonic()
        if conn.record is None:
            self._read_hello(sock, conn, data, now)
            return
        messages = conn.reader.feed(data) if data else []
        with self._lock:
            for message in messages:
                self._take(conn.record, message, now)
            conn.record.last_seen = now
            if not data and conn.record.ended is None:
                conn.record.ended, conn.record.ended_at = "lost", now
        if not data:
            self._drop(sock)

    def _read_hello(self, sock: socket.socket, conn: _Connection, data: bytes, now: float) -> None:
        if not data:
            self._drop(sock)  # gone before its hello: no one to tell
            return
        lines = conn.reader.split(data)
        if not lines and len(conn.reader.pending) <= _MAX_HELLO_BYTES:
            return  # the hello is on its way
        if not lines or len(lines[0]) > _MAX_HELLO_BYTES:
            self._refuse(sock, f"a first line longer than any hello ({_MAX_HELLO_BYTES} bytes)")
            return
        hello = parse_message(lines[0])
        with self._lock:
            why = self._greet(conn, hello, now)
            if why is None:
                for message in filter(None, map(parse_message, lines[1:])):
                    self._take(conn.record, message, now)
            update = self._update
            launch = self._launch
        if why is not None:
            self._refuse(sock, why)
            return
        del self._waiting[sock]
        try:
            send_message(sock, {"accepted": launch})
            # A rank still starting when the hosts changed (importing torch: seconds) hears it now;
            # the driver says each change once.
            if update is not None:
                send_message(sock, update)
        except OSError:
            pass

    def _greet(self, conn: _Connection, hello: dict | None, now: float) -> str | None:
        """Take ``hello`` as the first line of ``conn``: return why it is refused, or None (``conn.record`` set)."""
        if hello is None:
            return "the first line is not a JSON object"
        token = hello.get("hello")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self._token):
            return "the hello does not carry this job's token"  # a stranger: no log line
        launch, rank, size, host = (hello.get(key) for key in ("launch", "rank", "size", "host"))
        why = None
        if type(launch) is not int or launch != self._launch:
            why = f"launch {_quoted(launch)} is not the current start, {self._launch}"
        elif type(size) is not int or size != self._num_proc:
            why = f"size {_quoted(size)} is not the {self._num_proc} ranks of start {self._launch}"
        elif type(rank) is not int or not 0 <= rank < self._num_proc:
            why = f"rank {_quoted(rank)} is not one of the ranks 0..{self._num_proc - 1} of start {self._launch}"
        elif type(host) is not str or not 0 < len(host) <= 255 or not host.isprintable():
            why = f"host {_quoted(host)} is not a host name"
        if why is not None:
            log(f"refused a hello from {conn.peer}: {why}")
            return why
        known = self._records.get(rank)
        if known is not None:
            state = "running" if known.ended is None else f"ended ({known.ended})"
            log(
                f"refused a second hello for rank {rank} from {conn.peer} (rank {rank} on "
                f"{known.host} is {state} in start {self._launch}): its first connection stays the one watched"
            )
            return f"rank {rank} has connected already (from {known.host}) and is {state} in start {self._launch}"
        conn.record = self._records[rank] = RankRecord(rank=rank, host=host, last_seen=now)
        return None

    @staticmethod
    def _take(record: RankRecord, message: dict, now: float) -> None:
        commit = message.get("commit")
        if type(commit) is int:
            record.commit = max(record.commit, commit)
        for kind in ("done", "restart", "error"):
            if kind in message and record.ended is None:
                record.ended, record.ended_at = kind, now
                record.text = "" if message[kind] == 1 else str(message[kind])

    def _refuse(self, sock: socket.socket, why: str) -> None:
        try:
            send_message(sock, {"refused": why})
            sock.shutdown(socket.SHUT_WR)
            # Closed with unread bytes, a socket resets its peer, which may then lose the reply.
            sock.recv(65536)
        except OSError:
            pass  # gone, nothing more to read, or its buffer full: it is closed all the same
        self._drop(sock)

    def _lose(self, sock: socket.socket) -> None:
        conn = self._connections.get(sock)
        if conn is not None and conn.record is not None:
            with self._lock:
                if conn.record.ended is None:
                    conn.record.ended, conn.record.ended_at = "lost", time.monotonic()
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.pop(sock, None)
        self._waiting.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
