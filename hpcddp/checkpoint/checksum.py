"""A checksum at the end of every checkpoint file, so flipped bits and torn files are found, not loaded.

Layout: what ``torch.save`` wrote, then a 48-byte footer: ``HPCDDPck``, the SHA-256
of everything before the footer, and that length (little-endian). torch.load reads
such a file unchanged (its zip reader finds the archive's directory before the
footer), so a checkpoint stays an ordinary ``.pt`` file.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, BinaryIO

import torch

__all__ = ["UNVERIFIED", "checksum_problem", "save_with_checksum"]

_MAGIC = b"HPCDDPck"
_FOOTER = struct.Struct("<8s32sQ")
#: checksum_problem's answer for a file without a footer (written before checksums existed)
UNVERIFIED = "no checksum"


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self.hash = hashlib.sha256()
        self.size = 0
        #: the first write error (torch.save reports it only as "unexpected pos ...")
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(data)
        try:
            return self._fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self._fh.flush()


def save_with_checksum(obj: Any, fh: BinaryIO) -> None:
    """``torch.save(obj)`` into the open binary file ``fh``, then append the checksum footer."""
    writer = _HashingWriter(fh)
    try:
        torch.save(obj, writer)
    except Exception:
        if writer.error is not None:
            raise writer.error from None
        raise
    fh.write(_FOOTER.pack(_MAGIC, writer.hash.digest(), writer.size))


def checksum_problem(data) -> str | None:
    """Return None if the checksum footer of a checkpoint's bytes matches, ``UNVERIFIED`` without one, else what is wrong.

    Args:
        data: the whole file's bytes (a bytes-like object; a numpy array of uint8).
    """
    data = memoryview(data).cast("B")
    size = len(data)
    if size < _FOOTER.size:
        return UNVERIFIED
    magic, digest, length = _FOOTER.unpack(data[size - _FOOTER.size :])
    if magic != _MAGIC:
        return UNVERIFIED
    if length != size - _FOOTER.size:
        return f"its footer records {length} bytes of data, the file holds {size - _FOOTER.size}"
    if hashlib.sha256(data[:length]).digest() != digest:
        return "its SHA-256 checksum does not match its contents (flipped or overwritten bytes)"
    return None
