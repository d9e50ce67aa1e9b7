"""hpcddp's own environment variables (HPCDDP_*): the one place they are read."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .base import read_value

__all__ = ["read_float", "read_settings"]


def _seconds(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError(raw)
    return value


def read_float(environ: Mapping[str, str], name: str, default: float | None = None) -> float | None:
    """Read a number of seconds >= 0 from the environment; ``default`` when unset (see ``read_value``)."""
    return read_value(environ, name, _seconds, "a number of seconds >= 0", default)


def read_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """Return the InitConfig fields set through HPCDDP_* variables (only those that are set).

    HPCDDP_STALL_TIMEOUT sets ``stall_timeout`` (seconds), HPCDDP_STALL_ACTION sets
    ``stall_action``, HPCDDP_TIMELINE sets ``timeline`` (a path); an explicit
    ``init()`` argument wins over any of them.

    Args:
        environ: the environment to read (``os.environ`` or a test's dict).
    """
    settings: dict[str, Any] = {}
    timeout = read_float(environ, "HPCDDP_STALL_TIMEOUT")
    if timeout is not None:
        settings["stall_timeout"] = timeout
    action = environ.get("HPCDDP_STALL_ACTION", "").strip().lower()
    if action:
        if action not in ("abort", "warn"):
            raise ValueError(f"environment variable HPCDDP_STALL_ACTION must be 'abort' or 'warn', got {action!r}")
        settings["stall_action"] = action
    timeline = environ.get("HPCDDP_TIMELINE", "").strip()
    if timeline:
        settings["timeline"] = timeline
    return settings
