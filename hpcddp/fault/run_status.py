"""Which ranks of an ``hpcddp run`` job started and which finished, told through small files.

Open MPI 5.0's mpirun exits 0 when it loses a node's daemon (the node crashed or was cut
off), after killing the ranks it still reaches: the job would look like a success.
``hpcddp run`` therefore names a directory (HPCDDP_RUN_STATUS, under the working
directory, which clusters share between nodes); every rank that ``hpcddp.init()``
starts writes ``<rank>.started`` there and ``<rank>.finished`` when its interpreter
exits normally. A rank that started and never finished did not end by itself.
"""

from __future__ import annotations

import atexit
import socket
from pathlib import Path

__all__ = ["mark_started", "started_ranks", "unfinished_ranks"]


def mark_started(directory: str, rank: int) -> None:
    """Record that ``rank`` started; its normal interpreter exit records that it finished.

    Args:
        directory: the job's status directory (HPCDDP_RUN_STATUS).
        rank: this process's rank.
    """
    path = Path(directory)
    try:
        (path / f"{rank}.started").write_text(socket.gethostname())
    except OSError:  # not shared with this node, or gone: nothing to check then
        return
    atexit.register(_mark_finished, path / f"{rank}.finished")


def _mark_finished(path: Path) -> None:
    try:
        path.write_text("")
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
            missing[int(rank)] = started.read_text().strip() or "?"
    return dict(sorted(missing.items()))


def started_ranks(directory: str) -> int:
    """Return how many ranks recorded that they started.

    Args:
        directory: the job's status directory.
    """
    return sum(1 for _ in Path(directory).glob("*.started"))
