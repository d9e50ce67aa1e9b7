"""The elastic driver's log: one line on stderr for each thing it does or refuses."""

from __future__ import annotations

import sys
import time

__all__ = ["log"]


def log(message: str) -> None:
    """Write one line of the driver's log to stderr."""
    sys.stderr.write(f"[hpcddp run] elastic {time.strftime('%H:%M:%S')}: {message}\n")
    sys.stderr.flush()
