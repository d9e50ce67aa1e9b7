"""Where Open MPI keeps the memory of shared windows on this node, and how much room is left there.

``MPI_Win_allocate_shared`` in Open MPI (osc/sm) backs a window with a file in
``osc_sm_backing_directory`` (``/dev/shm`` on Linux by default; ``ompi_info --all |
grep osc_sm_backing``). A window larger than the room left there fails with
MPI_ERR_INTERN on the rank that makes the file while the node's other ranks wait for
it; Docker gives containers a 64 MB ``/dev/shm`` unless told ``--shm-size``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["BACKING_DIRECTORY_KNOB", "free_bytes", "window_backing_directory"]

#: Open MPI's knob naming the directory of shared windows' backing files
BACKING_DIRECTORY_KNOB = "OMPI_MCA_osc_sm_backing_directory"


def window_backing_directory(environ: Mapping[str, str] | None = None) -> str:
    """Return the directory that backs MPI shared-memory windows on this node.

    Args:
        environ: the environment to read (``os.environ`` when None).
    """
    environ = os.environ if environ is None else environ
    return environ.get(BACKING_DIRECTORY_KNOB, "").strip() or "/dev/shm"


def free_bytes(directory: str) -> int | None:
    """Return the bytes an unprivileged process may still write in ``directory``; None when unknown.

    Args:
        directory: a directory on the filesystem to ask about.
    """
    try:
        info = os.statvfs(directory)
    except OSError:  # missing (not Linux: Open MPI uses its session directory), or not ours to ask
        return None
    return info.f_bavail * info.f_frsize
