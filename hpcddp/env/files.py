"""Files that appear whole or not at all, and files read or written by a fixed name.

Used for checkpoints, timelines, the owner and run marker of a checkpoint directory,
the status files of ``hpcddp run`` (appended to, ``append_no_follow``), elastic commits and each rank's timeline events. A file is written to a private
temporary file created exclusively with a random name (``mkstemp``: ``O_CREAT |
O_EXCL``), fsynced and renamed into place, so a file or symbolic link planted at a
predictable name is never followed or truncated (the rename replaces the link itself),
and two writers never share one. A file read by a fixed name is opened with
``O_NOFOLLOW``: a link planted there by whoever may write in the directory would
otherwise make this job read, and quote in its errors, any file it can reach.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "PendingFile",
    "append_no_follow",
    "create_exclusively",
    "make_directory_no_follow",
    "open_no_follow",
    "probe_writable",
    "read_text_no_follow",
    "write_atomically",
]

_FULL = (errno.ENOSPC, errno.EDQUOT)
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS)  # some FUSE and object-store mounts


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


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """Open ``path`` with ``os.open`` ``flags`` unless it is a symbolic link or not a regular file.

    Args:
        path: the file.
        flags: ``os.O_RDONLY``, or ``os.O_WRONLY | os.O_CREAT ...``.
        mode: the permissions of a file it creates (before the umask).

    Raises:
        OSError: ``path`` is a symbolic link (ELOOP) or not a regular file, in one line
            naming it and the fix; or the error of the open itself.
    """
    # O_NONBLOCK: a FIFO planted at the name must not block the open; a regular file ignores it.
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP and os.path.islink(path):
            raise OSError(
                errno.ELOOP,
                f"{path} is a symbolic link, which hpcddp will not follow (it could point at any file this job may "
                "read or write): remove it",
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file, which hpcddp will not read or write: remove it")
    return fd


def read_text_no_follow(path: str | os.PathLike, limit: int = 1 << 16) -> str:
    """Return the first ``limit`` bytes of the regular file ``path`` as text, never following a symbolic link.

    Args:
        path: the file.
        limit: how much to read at most (the small files hpcddp keeps).

    Raises:
        OSError: as ``open_no_follow``; FileNotFoundError when it does not exist.
    """
    with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as fh:
        return fh.read(limit).decode("utf-8", errors="replace")


def append_no_follow(path: Path, data: bytes, what: str) -> None:
    """Append ``data`` to the regular file ``path`` in one write (creating it), never following a symbolic link.

    For short records that several processes of one node add to one file (``O_APPEND``:
    the kernel serialises the writes of one machine, so records never interleave); a
    reader should ignore a last record cut short.

    Args:
        path: the file.
        data: one record, a few hundred bytes at most.
        what: what the file is, for the error on a full disk ("run status file").

    Raises:
        OSError: as ``open_no_follow``, or on a full disk or quota, naming ``path`` and what to do.
    """
    fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, data)
        # On the server before a crash of this node: a record lost with the node is what readers look for.
        os.fsync(fd)
    except OSError as err:
        if err.errno in _FULL:
            raise _full_disk(err, path, what, "") from None
        raise
    finally:
        os.close(fd)


def _full_disk(err: OSError, path: Path, what: str, kept: str) -> OSError:
    return OSError(
        err.errno,
        f"{os.strerror(err.errno)} while writing {what} {path}{kept}: free space or raise the quota there, or "
        "write somewhere else",
    )


def _write_temporary(path: Path, write: Callable[[BinaryIO], None], what: str, kept: str) -> str:
    """Write a private temporary file beside ``path`` through ``write``, fsynced; return its name.

    On any failure the temporary file is removed; a full disk is named as ``_full_disk``.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; the result should be as readable as any file the user writes.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in _FULL:
            raise _full_disk(err, path, what, kept) from None
        raise
    return tmp


def _fsync_directory(directory: Path) -> None:
    # A rename or link is only durable once the directory entry is on disk too.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomically(path: Path, write: Callable[[BinaryIO], None], what: str) -> None:
    """Write ``path`` through ``write(file)`` so that it appears whole or not at all.

    A symbolic link at ``path`` is replaced, never followed.

    Args:
        path: the final name.
        write: writes the contents into the open binary file it is given.
        what: what the file is, for the error on a full disk ("checkpoint").

    Raises:
        OSError: on a full disk or quota, naming ``path`` and what to do; the file
            that was there before is kept.
    """
    tmp = _write_temporary(path, write, what, " (the older file is kept)")
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


class PendingFile:
    """A file written in pieces to a private temporary name beside ``path``, renamed to ``path`` by ``commit()``.

    Readers never see it half written, and a symbolic link planted at ``path`` is replaced,
    never followed (as ``write_atomically``, for data that arrive over time).

    Args:
        path: the final name.
        what: what the file is, for the error on a full disk ("timeline").
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self._what = what
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.fchmod(fd, 0o666 & ~_umask())
        self._file: BinaryIO | None = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        """Append ``data``.

        Raises:
            OSError: on a full disk or quota, naming ``path`` and what to do (the file is discarded).
        """
        assert self._file is not None, "write() after commit() or discard()"
        try:
            self._file.write(data)
        except OSError as err:
            self.discard()
            if err.errno in _FULL:
                raise _full_disk(err, self.path, self._what, "") from None
            raise

    def commit(self) -> None:
        """Flush, fsync and rename the file to ``path``."""
        assert self._file is not None, "commit() twice or after discard()"
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._tmp, self.path)
        except BaseException as err:
            self.discard()
            if isinstance(err, OSError) and err.errno in _FULL:
                raise _full_disk(err, self.path, self._what, "") from None
            raise
        _fsync_directory(self.path.parent)

    def discard(self) -> None:
        """Close and remove the temporary file; ``path`` is left as it was."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        Path(self._tmp).unlink(missing_ok=True)


def make_directory_no_follow(path: Path) -> None:
    """Create the directory ``path`` (and its parents) unless it exists; refuse a symbolic link there.

    Raises:
        OSError: ``path`` is a symbolic link or not a directory, in one line naming it and the fix.
    """
    if not os.path.islink(path):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file by that name: named below
            pass
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise OSError(
            errno.ELOOP,
            f"{path} is a symbolic link, which hpcddp will not follow (it could point at any directory this job may "
            "write): remove it",
        )
    if not stat.S_ISDIR(mode):
        raise OSError(errno.ENOTDIR, f"{path} is not a directory: remove it or choose another path")


def create_exclusively(path: Path, data: bytes, what: str) -> bool:
    """Create ``path`` holding ``data`` unless something (a file, a symbolic link) is there; return whether it did.

    The data go to a private temporary file that is then hard-linked to ``path``, so a
    reader never sees the file empty or cut short, and a full disk leaves nothing behind.

    Args:
        path: the name to create.
        data: its contents.
        what: what the file is, for the error on a full disk ("owner file").

    Raises:
        OSError: on a full disk or quota, naming ``path`` and what to do.
    """
    tmp = _write_temporary(path, lambda fh: fh.write(data), what, "")
    try:
        os.link(tmp, path)  # fails on any existing name, a symbolic link included; follows none
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno in _FULL:
            raise _full_disk(err, path, what, "") from None
        if err.errno not in _NO_HARD_LINKS:
            raise
        return _create_in_place(path, data, what)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _fsync_directory(path.parent)
    return True


def _create_in_place(path: Path, data: bytes, what: str) -> bool:
    """``create_exclusively`` where hard links are not allowed: create exclusively, write, remove on failure."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as err:
        path.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in _FULL:
            raise _full_disk(err, path, what, "") from None
        raise
    return True


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
