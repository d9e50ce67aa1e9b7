"""Which ranks of an ``hpcddp run`` job started and which finished, told through small files.

Open MPI 5.0's mpirun exits 0 when it loses a node's daemon (the node crashed or was cut
off), after killing the ranks it still reaches: the job would look like a success.
``hpcddp run`` therefore names a directory (HPCDDP_RUN_STATUS, under the working
directory, which clusters share between nodes); every rank that ``hpcddp.init()``
starts writes ``<rank>.started`` there and ``<rank>.finished`` when its interpreter
exits normally. A rank that started and never finished did not end by itself.
A rank that ends the whole job (``hpcddp.fault.abort``) writes ``<rank>.aborted``
first, so that ``hpcddp run`` can stop an mpirun that never exits after the abort
(it waits on the daemon of a node it cannot reach).

Every file is written whole through a private temporary name and read without
following a symbolic link (``hpcddp.env.files``): a link planted at a rank's file name
is replaced, never written through, and its target is never read.
"""

from __future__ import annotations

import atexit
import socket
from pathlib import Path

from ..env.files import read_text_no_follow, write_atomically

__all__ = ["aborted_ranks", "mark_aborted", "mark_started", "started_ranks", "unfinished_ranks"]


def mark_started(directory: str, rank: int) -> None:
    """Record that ``rank`` started; its normal interpreter exit records that it finished.

    Args:
        directory: the job's status directory (HPCDDP_RUN_STATUS).
        rank: this process's rank.
    """
    path = Path(directory)
    try:
        _write(path / f"{rank}.started", socket.gethostname())
    except OSError:  # not shared with this node, or gone: nothing to check then
        return
    atexit.register(_mark_finished, path / f"{rank}.finished")


def _write(path: Path, text: str) -> None:
    write_atomically(path, lambda fh: fh.write(text.encode()), "run status file")


def _read(path: Path) -> str | None:
    """The text of a rank's status file, or None when it is gone, or is not a regular file (a planted link)."""
    try:
        return read_text_no_follow(path, limit=256).strip()
    except OSError:
        return None


def _mark_finished(path: Path) -> None:
    try:
        _write(path, "")
    except OSError:
        pass


def unfinished_ranks(directory: str) -> dict[int, str]:
    """Return {rank: host} of the ranks that started but did not finish.

    Args:
        directory: the job's status directory.
    """
    path = Path(directory)
    missing = {}
    for started in path.glob("*.started"):
        rank = started.name.removesuffix(".started")
        if rank.isdigit() and not (path / f"{rank}.finished").exists():
            missing[int(rank)] = _read(started) or "?"
    return dict(sorted(missing.items()))


def started_ranks(directory: str) -> int:
    """Return how many ranks recorded that they started.

    Args:
        directory: the job's status directory.
    """
    return sum(1 for _ in Path(directory).glob("*.started"))


def mark_aborted(directory: str, rank: int, code: int) -> None:
    """Record that ``rank`` is ending the whole job with exit code ``code``.

    Args:
        directory: the job's status directory (HPCDDP_RUN_STATUS).
        rank: this process's rank.
        code: the job's exit code.
    """
    try:
        _write(Path(directory) / f"{rank}.aborted", str(code))  # whole or absent: a reader never sees an empty code
    except OSError:
        pass


def aborted_ranks(directory: str) -> dict[int, int]:
    """Return {rank: exit code} of the ranks that ended the whole job.

    Args:
        directory: the job's status directory.
    """
    aborted = {}
    for path in Path(directory).glob("*.aborted"):
        rank, code = path.name.removesuffix(".aborted"), _read(path)
        if rank.isdigit() and code is not None:
            aborted[int(rank)] = int(code) if code.isdigit() else 1
    return dict(sorted(aborted.items()))
