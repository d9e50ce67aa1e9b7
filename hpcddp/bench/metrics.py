"""Arithmetic shared by the benchmarks: sizes, bandwidths (nccl-tests' definitions), medians."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

__all__ = ["algbw", "busbw", "format_size", "median", "parse_size", "size_sweep"]

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str | int, argument: str = "size") -> int:
    """Turn ``"8"``, ``"64K"``, ``"256M"`` or ``"1GiB"`` (binary units) into a number of bytes.

    Args:
        text: the user's value, or an int already in bytes.
        argument: the option name to put in the error message.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{argument} must be a byte count such as 8, 64K or 256M, got {text!r}")
        value = int(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{argument} must be > 0 bytes, got {text!r}")
    return value


def size_sweep(min_bytes: int, max_bytes: int, element_size: int = 4) -> list[int]:
    """Return message sizes from ``min_bytes`` doubling up to ``max_bytes`` (both included when reached).

    Args:
        min_bytes: the first size; a multiple of ``element_size``.
        max_bytes: the largest size allowed; at least ``min_bytes``.
        element_size: bytes per element of the buffers the sizes describe.
    """
    if min_bytes % element_size:
        raise ValueError(f"--min must be a multiple of {element_size} bytes (one float32), got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"--max must be >= --min ({format_size(min_bytes)}), got {format_size(max_bytes)}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def algbw(nbytes: int, seconds: float) -> float:
    """Return the algorithm bandwidth in GB/s (1e9 bytes): message size over time.

    Args:
        nbytes: bytes each rank contributes.
        seconds: time of one allreduce.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return nbytes / seconds / 1e9


def busbw(algbw_gbs: float, num_ranks: int) -> float:
    """Return the bus bandwidth of an allreduce: ``algbw * 2(n-1)/n`` (nccl-tests' PERFORMANCE.md).

    It is comparable across world sizes and with the hardware's peak link bandwidth.

    Args:
        algbw_gbs: algorithm bandwidth, see ``algbw``.
        num_ranks: ranks taking part.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    return algbw_gbs * 2 * (num_ranks - 1) / num_ranks


def median(values: Sequence[float]) -> float:
    """Return the median of ``values`` (the middle of an odd count, the mean of the two middles otherwise)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def format_size(nbytes: int) -> str:
    """Return ``nbytes`` as ``8B``, ``64KiB``, ``256MiB``: the largest exact binary unit."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"
