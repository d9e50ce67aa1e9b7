"""Which ranks of an ``hpcddp run`` job started and which finished, told through one small file per node.

Open MPI 5.0's mpirun exits 0 when it loses a node's daemon (the node crashed or was cut
off), after killing the ranks it still reaches: the job would look like a success.
``hpcddp run`` therefore names a directory (HPCDDP_RUN_STATUS, under the working
directory, which clusters share between nodes); every rank that ``hpcddp.init()``
starts adds ``started <rank> <host>`` to its node's file ``<host>.ranks`` there, and
``finished <rank>`` when its interpreter exits normally. A rank that started and
never finished did not end by itself. A rank that ends the whole job
(``hpcddp.fault.abort``) adds ``<rank> <code>`` to ``<host>.aborted`` first, so that
``hpcddp run`` can stop an mpirun that never exits after the abort (it waits on the
daemon of a node it cannot reach).

One file per node, not per rank: a shared filesystem's metadata server creates a file
per node once (512 at 4,096 ranks on 8-rank nodes, instead of 8,192 files made through
a temporary name and a rename each), and the ranks of a node only append to it. Each
rank writes its own records: only the rank itself knows that it reached its normal
exit, and a rank killed after its node's other ranks finished must still be caught.
Appends from one node do not interleave (``hpcddp.env.files.append_no_follow``); a
reader ignores a record cut short.

Every file is opened without following a symbolic link and only if it is a regular
file (``hpcddp.env.files``): a link planted at a node's file name is refused, never
written through, and its target is never read.
"""

from __future__ import annotations

import atexit
import re
import socket
from pathlib import Path

from ..env.files import append_no_follow, read_text_no_follow

__all__ = ["aborted_ranks", "mark_aborted", "mark_started", "started_ranks", "unfinished_ranks"]

_RANKS, _ABORTED = ".ranks", ".aborted"
#: how much of a node's file is read: two records of ~40 bytes per rank, for thousands of ranks per node
_READ_AT_MOST = 1 << 20


def _node_file(directory: str, suffix: str) -> Path:
    # A host name is [A-Za-z0-9.-]; anything else must not make a path of it.
    return Path(directory) / (re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).lstrip(".") + suffix)


def _append(path: Path, record: str) -> None:
    append_no_follow(path, f"{record}\n".encode(), "run status file")


def _records(directory: str, suffix: str):
    """Yield the whole records (split into words) of every node's file ending in ``suffix``."""
    for path in Path(directory).glob(f"*{suffix}"):
        try:
            text = read_text_no_follow(path, limit=_READ_AT_MOST)
        except OSError:  # gone, or not a regular file (a planted link): no rank's word
            continue
        for line in text.split("\n")[:-1]:  # the last is empty, or a record cut short
            yield line.split()


def mark_started(directory: str, rank: int) -> None:
    """Record that ``rank`` started; its normal interpreter exit records that it finished.

    Args:
        directory: the job's status directory (HPCDDP_RUN_STATUS).
        rank: this process's rank.
    """
    path = _node_file(directory, _RANKS)
    try:
        _append(path, f"started {rank} {socket.gethostname()}")
    except OSError:  # not shared with this node, or gone: nothing to check then
        return
    atexit.register(_mark_finished, path, rank)


def _mark_finished(path: Path, rank: int) -> None:
    try:
        _append(path, f"finished {rank}")
    except OSError:
        pass


def _started_and_finished(directory: str) -> tuple[dict[int, str], set[int]]:
    started, finished = {}, set()
    for words in _records(directory, _RANKS):
        if len(words) >= 2 and words[1].isdigit():
            if words[0] == "started":
                started[int(words[1])] = words[2] if len(words) > 2 else "?"
            elif words[0] == "finished":
                finished.add(int(words[1]))
    return started, finished


def unfinished_ranks(directory: str) -> dict[int, str]:
    """Return {rank: host} of the ranks that started but did not finish.

    Args:
        directory: the job's status directory.
    """
    started, finished = _started_and_finished(directory)
    return {rank: host for rank, host in sorted(started.items()) if rank not in finished}


def started_ranks(directory: str) -> int:
    """Return how many ranks recorded that they started.

    Args:
        directory: the job's status directory.
    """
    return len(_started_and_finished(directory)[0])


def mark_aborted(directory: str, rank: int, code: int) -> None:
    """Record that ``rank`` is ending the whole job with exit code ``code``.

    Args:
        directory: the job's status directory (HPCDDP_RUN_STATUS).
        rank: this process's rank.
        code: the job's exit code.
    """
    try:
        _append(_node_file(directory, _ABORTED), f"{rank} {code}")  # one write: a reader never sees half a code
    except OSError:
        pass


def aborted_ranks(directory: str) -> dict[int, int]:
    """Return {rank: exit code} of the ranks that ended the whole job.

    Args:
        directory: the job's status directory.
    """
    aborted = {}
    for words in _records(directory, _ABORTED):
        if len(words) == 2 and words[0].isdigit():
            aborted.setdefault(int(words[0]), int(words[1]) if words[1].isdigit() else 1)
    return dict(sorted(aborted.items()))
