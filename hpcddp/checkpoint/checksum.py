"""A checksum at the end of every checkpoint file, so flipped bits and torn files are found, not loaded.

Layout: what ``torch.save`` wrote, then a 48-byte footer: ``HPCDDPck``, the SHA-256
of everything before the footer, and that length (little-endian). torch.load reads
such a file unchanged (its zip reader finds the archive's directory before the
footer), so a checkpoint stays an ordinary ``.pt`` file.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["UNVERIFIED", "save_with_checksum", "verify_checksum"]

_MAGIC = b"HPCDDPck"
_FOOTER = struct.Struct("<8s32sQ")
_CHUNK = 1 << 22
#: verify_checksum's answer for a file without a footer (written before checksums existed)
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


def verify_checksum(path: str | os.PathLike) -> str | None:
    """Return None if ``path``'s checksum matches, ``UNVERIFIED`` without one, else what is wrong.

    Args:
        path: a checkpoint file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if size < _FOOTER.size:
            return UNVERIFIED
        fh.seek(size - _FOOTER.size)
        magic, digest, length = _FOOTER.unpack(fh.read(_FOOTER.size))
        if magic != _MAGIC:
            return UNVERIFIED
        if length != size - _FOOTER.size:
            return f"its footer records {length} bytes of data, the file holds {size - _FOOTER.size}"
        fh.seek(0)
        actual = hashlib.sha256()
        remaining = length
        while remaining:
            chunk = fh.read(min(_CHUNK, remaining))
            if not chunk:
                return "it ended while its checksum was being computed"
            actual.update(chunk)
            remaining -= len(chunk)
    if actual.digest() != digest:
        return "its SHA-256 checksum does not match its contents (flipped or overwritten bytes)"
    return None
