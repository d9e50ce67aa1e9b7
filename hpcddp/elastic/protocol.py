"""Messages between an elastic job's ranks and its driver: one JSON object per line over TCP.

Rank to driver: ``{"hello": token, "rank", "size", "host", "launch"}`` once, then
``{"beat": 1}`` every ``BEAT_INTERVAL_S``, ``{"commit": serial}`` from rank 0 after each
commit, and at the end one of ``{"done": 1}`` (the
script finished), ``{"restart": reason}`` (the ranks leave to be started again on other
hosts) or ``{"error": text}`` (the script failed: no restart can help). Driver to rank:
``{"accepted": launch}`` or ``{"refused": why}`` (and the connection closed) in answer to the
hello, then ``{"hosts_updated": timestamp, "update": HostUpdate}``.
"""

from __future__ import annotations

import enum
import json
import socket
from typing import Any

__all__ = ["BEAT_INTERVAL_S", "HostUpdate", "LineReader", "parse_message", "send_message"]

#: how often a rank says it is alive
BEAT_INTERVAL_S = 1.0


class HostUpdate(enum.IntFlag):
    """What changed in the hosts (Horovod's ``HostUpdateResult`` values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one message (raises OSError when the peer is gone)."""
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def parse_message(line: bytes) -> dict[str, Any] | None:
    """Return the JSON object that ``line`` holds, or None when it holds anything else."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." from a stranger
        return None
    return message if isinstance(message, dict) else None


class LineReader:
    """Split a stream of bytes into the JSON messages it carries."""

    def __init__(self) -> None:
        self._buffer = b""

    @property
    def pending(self) -> bytes:
        """The bytes received after the last complete line."""
        return self._buffer

    def split(self, data: bytes) -> list[bytes]:
        """Add received bytes and return the complete lines among them."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return lines

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add received bytes and return the complete messages among them (malformed lines are dropped)."""
        return [message for message in map(parse_message, self.split(data)) if message is not None]
