"""Read a checkpoint once per job, check it once, and load it on every rank from memory.

Rank 0 lists the directory, reads the newest checkpoint into a buffer that the
communicator shares (``Communicator.share_bytes``: once per node in shared memory on
MPI, the bytes crossing between nodes once over MPI) and checks its checksum; the
verdict reaches every rank before the bytes do, so a damaged file is skipped on every
rank alike and the next older one tried. Every rank then ``torch.load``\\ s the same
bytes. A 100 MB checkpoint at 4 ranks on one node is read 1.0x its size, not 8x
(each rank reading it twice: checksum, then load; docs/BENCHMARKS.md).

One reader per job rather than one per node: the parallel filesystem serves the file
once (10 GB at 512 nodes is 10 GB read, not 5 TB), ranks cannot resume from different
steps because one node listed the directory late, and ranks on nodes that cannot see
the directory resume too. The bytes cross the network once per node either way.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..comm.base import PrivateBytes
from ..ddp.step_counters import keep_step_counters_on_cpu_
from ..env.files import open_no_follow
from .checksum import UNVERIFIED, checksum_problem

__all__ = ["load_newest"]

log = logging.getLogger("hpcddp")


class _MemoryReader(io.RawIOBase):
    """A read-only, seekable file over a buffer, so that ``torch.load`` reads it without copying it first."""

    def __init__(self, data) -> None:
        super().__init__()
        self._data = memoryview(data).cast("B")
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), len(self._data) - self._position))
        memoryview(buffer).cast("B")[:count] = self._data[self._position : self._position + count]
        self._position += count
        return count


def _read_into(path: Path, array: np.ndarray, follow_links: bool) -> str | None:
    """Fill ``array`` with the file's bytes; return what went wrong, or None."""
    try:
        opened = (
            open(path, "rb", buffering=0) if follow_links else os.fdopen(open_no_follow(path, os.O_RDONLY), "rb", 0)
        )
        with opened as fh:
            view, done = memoryview(array), 0
            while done < len(array):
                count = fh.readinto(view[done:])
                if not count:
                    return f"it ended after {done} of its {len(array)} bytes while being read"
                done += count
            if fh.read(1):
                return f"it grew beyond its {len(array)} bytes while being read"
    except OSError as err:
        return f"it cannot be read: {err}"
    return None


def _load_from(array: np.ndarray, map_location: Any, weights_only: bool) -> Any:
    with _MemoryReader(array) as reader:
        return keep_step_counters_on_cpu_(torch.load(reader, map_location=map_location, weights_only=weights_only))


def _from_root(comm, obj: Any) -> Any:
    return obj if comm is None or comm.size == 1 else comm.broadcast_object(obj, 0)


def _first_failure(comm, error: BaseException | None) -> tuple[int, str] | None:
    """(rank, what) of the lowest rank whose load raised, on every rank; None when every rank loaded."""
    if comm is None or comm.size == 1:
        return None if error is None else (0, f"{type(error).__name__}: {error}")
    from ..comm.base import ReduceOp

    failed = int(comm.allreduce_(torch.tensor([comm.rank if error is not None else comm.size]), ReduceOp.MIN))
    if failed == comm.size:
        return None
    return failed, comm.broadcast_object(None if error is None else f"{type(error).__name__}: {error}", failed)


def _load_shared(
    comm, path: Path, nbytes: int, map_location: Any, weights_only: bool, follow_links: bool
) -> tuple[Any, str | None]:
    """Return (state, None), or (None, what is wrong) for a damaged file, on every rank alike; rank 0 reads."""
    shared = PrivateBytes(None, nbytes, 0) if comm is None else comm.share_bytes(nbytes, 0)
    with shared:
        verdict = None
        if comm is None or comm.rank == 0:
            try:
                verdict = _read_into(path, shared.array, follow_links) or checksum_problem(shared.array)
            except Exception as err:  # not the file's fault (e.g. MemoryError): raised below on every rank
                verdict = (f"{type(err).__name__}: {err}",)
        verdict = _from_root(comm, verdict)
        if isinstance(verdict, tuple):
            raise RuntimeError(f"rank 0 could not read checkpoint {path}: {verdict[0]}")
        if verdict is not None and verdict != UNVERIFIED:
            return None, verdict
        shared.share()
        state, error = None, None
        try:
            state = _load_from(shared.array, map_location, weights_only)
        except Exception as err:  # every rank hears of it below
            error = err
        failure = _first_failure(comm, error)
    if failure is None:
        log.debug("hpcddp: loaded checkpoint %s", path)
        return state, None
    # Without a checksum (written before hpcddp had them) a torn file shows only here, and
    # on rank 0 first: every rank has its bytes, so a load that fails elsewhere alone is
    # that rank's problem (memory, map_location), not damage to skip silently.
    if verdict is not None and failure[0] == 0:
        return None, f"it has no checksum and does not load: {failure[1]}"
    if error is not None:  # intact bytes that do not load: not damage, the caller's problem
        raise error
    raise ValueError(
        f"checkpoint {path} {'is intact' if verdict is None else 'loads on rank 0'}, but rank {failure[0]} cannot "
        f"load it ({failure[1]}): the ranks must load alike (the same map_location and weights_only on every rank, "
        "and the memory for it)"
    )


def _size_of(path: Path, follow_links: bool) -> tuple[int, str | None]:
    try:
        if not follow_links and path.is_symlink():
            return 0, f"it is a symbolic link (to {os.readlink(path)}), which hpcddp will not follow: remove it"
        return path.stat().st_size, None
    except OSError as err:
        return 0, f"it cannot be read: {err}"


def load_newest(
    comm, found: list[Path] | None, map_location: Any, weights_only: bool, follow_links: bool = False
) -> tuple[Path | None, Any, list[tuple[Path, str]]]:
    """Load the newest intact checkpoint of those rank 0 found, read once on rank 0; collective over ``comm``.

    Returns ``(path, state, skipped)`` on every rank (``path``, as rank 0 names it, None
    when none loads), ``skipped`` holding (path, what is wrong) for each damaged file.

    Args:
        comm: the ``Communicator``, or None for a process alone.
        found: on rank 0, the files to try, oldest first (e.g. ``find_checkpoints``);
            ignored elsewhere.
        map_location: torch.load's.
        weights_only: torch.load's.
        follow_links: read a file that is a symbolic link (one the caller named);
            otherwise it is skipped as damaged, on every rank, for a link planted at a
            checkpoint's name could point at any file. Read on rank 0 only.
    """
    rank = 0 if comm is None else comm.rank
    newest_first = list(reversed(found or [])) if rank == 0 else []
    skipped: list[tuple[Path, str]] = []
    for attempt in itertools.count():
        header = None
        if rank == 0 and attempt < len(newest_first):
            header = (str(newest_first[attempt]), *_size_of(newest_first[attempt], follow_links))
        header = _from_root(comm, header)
        if header is None:
            break
        name, nbytes, problem = header
        path = Path(name)
        state = None
        if problem is None:
            state, problem = _load_shared(comm, path, nbytes, map_location, weights_only, follow_links)
        if problem is None:
            return path, state, skipped
        skipped.append((path, problem))
        log.warning("hpcddp rank %d: skipping damaged checkpoint %s: %s", rank, path, problem)
    return None, None, skipped
