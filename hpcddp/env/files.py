"""Files that appear whole or not at all: a private temporary file, fsynced, renamed into place.

Used for checkpoints and timelines. The temporary file is created exclusively with a
random name (``mkstemp``: ``O_CREAT | O_EXCL``), so a file or symbolic link planted at
a predictable name is never followed or truncated, and two writers never share one.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["probe_writable", "write_atomically"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def _umask() -> int:
    # Read, not set-and-restore: os.umask would briefly change it for every thread.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def write_atomically(path: Path, write: Callable[[BinaryIO], None], what: str) -> None:
    """Write ``path`` through ``write(file)`` so that it appears whole or not at all.

    Args:
        path: the final name.
        write: writes the contents into the open binary file it is given.
        what: what the file is, for the error on a full disk ("checkpoint").

    Raises:
        OSError: on a full disk or quota, naming ``path`` and what to do; the file
            that was there before is kept.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; the result should be as readable as any file the user writes.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in _FULL:
            raise OSError(
                err.errno,
                f"{os.strerror(err.errno)} while writing {what} {path} (the older file is kept): "
                "free space or raise the quota there, or write somewhere else",
            ) from None
        raise
    # The rename is only durable once the directory entry is on disk too.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def probe_writable(directory: Path) -> str | None:
    """Return why files cannot be created in ``directory`` (making it), or None when they can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None
