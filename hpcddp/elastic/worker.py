"""A rank's side of an elastic job: its connection to the driver that ``hpcddp run --min-np`` runs.

The connection says the rank is alive (a beat a second: a node that goes silent is found
without waiting for TCP or MPI to notice), carries the driver's host updates to the
rank, and the rank's last word: done, restart, or error. Its thread touches only this
socket, never MPI or torch, so it keeps none of hpcddp's communication rules waiting.

A hello the driver refuses (``{"refused": why}``), or a connection it closes before it
accepts the hello, leaves the rank training unwatched: a loss of it would be seen only
when the job ends. The rank says so in one warning, with the driver's address and why
(another process that holds the job's token may have said hello as this rank first).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from ..env.elastic import DRIVER_VARIABLE, ElasticSession
from .protocol import BEAT_INTERVAL_S, HostUpdate, LineReader, send_message

__all__ = ["DriverLink"]

log = logging.getLogger("hpcddp")
Listener = Callable[[float, HostUpdate], None]
_CONNECT_TIMEOUT_S = 5.0


class DriverLink:
    """This rank's connection to the elastic driver.

    Args:
        session: the variables the driver gave this rank.
        rank: this rank in the current start of the job.
        size: the ranks in it.
        host: this node's name.
    """

    def __init__(self, session: ElasticSession, rank: int, size: int, host: str) -> None:
        self.session = session
        self.rank = rank
        self._sock = self._connect(session)
        peer_host, peer_port = self._sock.getpeername()[:2]
        self.address = f"{peer_host}:{peer_port}"
        self.accepted = False
        """Whether the driver accepted this rank's hello (it answers at once)."""
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._updates: list[tuple[float, HostUpdate]] = []
        self._closed = threading.Event()
        self._send({"hello": session.token, "rank": rank, "size": size, "host": host, "launch": session.launch})
        self._thread = threading.Thread(target=self._serve, name="hpcddp-elastic-link", daemon=True)
        self._thread.start()

    @staticmethod
    def _connect(session: ElasticSession) -> socket.socket:
        errors = []
        for address in session.addresses:
            try:
                sock = socket.create_connection((address, session.port), timeout=_CONNECT_TIMEOUT_S)
            except OSError as err:
                errors.append(f"{address}: {err.strerror or err}")
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise RuntimeError(
            f"cannot reach the elastic driver at port {session.port} of {', '.join(session.addresses)} "
            f"({'; '.join(errors)}): {DRIVER_VARIABLE} is set by hpcddp run --min-np; unset it to run without one"
        )

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(timestamp, update)`` for every host update, the ones received before too."""
        with self._lock:
            self._listeners.append(listener)
            earlier = list(self._updates)
        for timestamp, update in earlier:
            listener(timestamp, update)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def report_commit(self, serial: int) -> None:
        """Tell the driver that commit ``serial`` is kept (it tells failures that lose progress from ones that loop)."""
        self._send({"commit": serial})

    def finish(self, kind: str, text: str = "") -> None:
        """Send the rank's last word (``done``, ``restart`` or ``error``) and close the connection."""
        if kind not in ("done", "restart", "error"):
            raise ValueError(f"kind must be 'done', 'restart' or 'error', got {kind!r}")
        self._send({kind: text or 1})
        self.close()

    def close(self) -> None:
        """Close the connection (the driver reads a close without a last word as a lost rank)."""
        if not self._closed.is_set():
            self._closed.set()
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=2 * BEAT_INTERVAL_S)

    def _send(self, message: dict) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            try:
                send_message(self._sock, message)
            except OSError:
                pass  # the driver is gone: it ends the job, nothing for this rank to do

    def _serve(self) -> None:
        reader = LineReader()
        next_beat = time.monotonic() + BEAT_INTERVAL_S
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select([self._sock], [], [], max(0.0, next_beat - time.monotonic()))
                if readable:
                    data = self._sock.recv(65536)
                    if not data:
                        self._closed_before_accepted("closed the connection")
                        return
                    for message in reader.feed(data):
                        if "refused" in message:
                            self._warn_unwatched(f"refused this rank's hello ({message['refused']})")
                            return
                        self._deliver(message)
            except (OSError, ValueError) as err:  # reset by the driver, or closed under us
                self._closed_before_accepted(f"broke the connection ({err})")
                return
            if time.monotonic() >= next_beat:
                self._send({"beat": 1})
                next_beat = time.monotonic() + BEAT_INTERVAL_S

    def _closed_before_accepted(self, what: str) -> None:
        # After the driver accepted the hello, a close is the driver's end: it ends the job itself.
        if not self.accepted and not self._closed.is_set():
            self._warn_unwatched(f"{what} before it accepted this rank's hello")

    def _warn_unwatched(self, what: str) -> None:
        what = " ".join(str(what).split())[:400]  # one line, whatever the driver said
        log.warning(
            "hpcddp rank %d: the elastic driver at %s %s: this rank trains unwatched, its loss seen only when "
            "the job ends (a process holding the job's token may have said hello as rank %d first)",
            self.rank,
            self.address,
            what,
            self.rank,
        )

    def _deliver(self, message: dict) -> None:
        if "accepted" in message:
            self.accepted = True
            return
        if "hosts_updated" not in message:
            return
        update = (float(message["hosts_updated"]), HostUpdate(int(message.get("update", 0))))
        with self._lock:
            self._updates.append(update)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(*update)
