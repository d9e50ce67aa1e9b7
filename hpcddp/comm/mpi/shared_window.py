"""Bytes that one rank fills and every rank reads, held once per node in MPI shared memory.

The buffer is one shared-memory window per node (``MPI_Win_allocate_shared`` on
the node's ranks): root's node holds root's bytes, the first rank of each other node
receives them (one ``MPI_Bcast`` between nodes, in pieces MPI can count) and the
node's other ranks read that memory, so a node holds the bytes once, not once per
rank. A node whose shared-memory directory (``/dev/shm``, see
``hpcddp.env.shared_memory``) lacks room for the window gives each of its ranks its
own buffer instead, with one warning, and broadcasts into them on the node; a window
that still fails to allocate raises the same error on every rank. Other backends
give each rank its own buffer and broadcast into it (``hpcddp.comm.base.PrivateBytes``).
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

from ...env.mpi_import import import_mpi
from ...env.shared_memory import BACKING_DIRECTORY_KNOB, free_bytes, window_backing_directory
from ..base import PrivateBytes
from .buffers import for_each_piece

__all__ = ["NodeSharedBytes", "allocate_window"]

log = logging.getLogger("hpcddp")

#: room left beside a window: Open MPI rounds it up and keeps its own segments in the same directory
_HEADROOM_BYTES = 1 << 20


def _choose_buffer(nbytes: int, rank: int) -> str:
    """On the rank that holds the node's bytes: "window", "private" (no room for one, with one warning) or an error."""
    try:  # an address space limit (ulimit -v) fails the window inside MPI, leaving the node's other ranks in it
        if nbytes:
            mmap.mmap(-1, nbytes).close()
    except (OSError, ValueError, OverflowError) as err:
        return (
            f"rank {rank} cannot map the {nbytes / 2**20:.1f} MiB to share ({err}): raise its memory limit (ulimit -v)"
        )
    directory = window_backing_directory()
    free = free_bytes(directory)
    if free is None or nbytes + _HEADROOM_BYTES <= free:
        return "window"
    log.warning(
        "hpcddp: %.1f MiB (%d bytes) do not fit in the %.1f MiB free in %s (MPI shared memory), so each rank of "
        "this node holds its own copy: enlarge it (docker run --shm-size) or point %s at a local directory with room",
        nbytes / 2**20,
        nbytes,
        free / 2**20,
        directory,
        BACKING_DIRECTORY_KNOB,
    )
    return "private"


def allocate_window(MPI, nbytes: int, node):
    """Return ``MPI.Win.Allocate_shared(nbytes, 1, comm=node)`` (collective on ``node``).

    Args:
        MPI: mpi4py's MPI module.
        nbytes: this rank's share of the window.
        node: the node's communicator.
    """
    return MPI.Win.Allocate_shared(nbytes, 1, comm=node)


class NodeSharedBytes(PrivateBytes):
    """``nbytes`` bytes held once per node in MPI shared memory; made by ``MPICommunicator.share_bytes``.

    Args:
        comm: the ``MPICommunicator``; its runner makes every MPI call, in its order.
        nbytes: the buffer's size, the same on every rank.
        root: the rank that fills ``array`` before ``share()``.
    """

    def __init__(self, comm, nbytes: int, root: int) -> None:
        self._comm, self._root, self._MPI = comm, root, import_mpi()
        self._window = self._across = self._node = None  # _node: the node's ranks, when each has its own buffer
        self._holder = 0
        self.array = comm.run(comm.plan_shared_bytes(lambda: self._open(nbytes), root))

    def _open(self, nbytes: int) -> np.ndarray:
        """Make the node's window (or, without room for it, a buffer per rank) and the communicator between nodes."""
        MPI, comm, rank, root = self._MPI, self._comm.mpi_comm, self._comm.rank, self._root
        node = self._comm.node_comm()
        # The rank that holds the node's bytes: root on its node, the node's first rank elsewhere.
        holder = node.allreduce(node.Get_rank() if rank == root else node.Get_size(), op=MPI.MIN)
        self._holder = holder = holder if holder < node.Get_size() else 0
        holds = node.Get_rank() == holder
        # Root first (key -1), so that it is rank 0 of the holders' communicator.
        across = comm.Split(0 if holds else MPI.UNDEFINED, -1 if rank == root else rank)
        self._across = None if across == MPI.COMM_NULL else across
        # A window without room behind it fails inside MPI on the holder alone, while the
        # node's other ranks wait in it for ever: the node decides beforehand, on the holder's word.
        plan = node.bcast(_choose_buffer(nbytes, rank) if holds else None, root=holder)
        error, array = None, None
        try:
            if plan == "window":
                self._window = allocate_window(MPI, nbytes if holds else 0, node)
            elif plan == "private":
                self._node = node  # filled by a broadcast on the node in share()
                array = np.empty(nbytes, dtype=np.uint8)
            else:
                error = plan
        except (MPI.Exception, MemoryError) as err:
            error = (
                f"rank {rank} could not allocate {nbytes / 2**20:.1f} MiB to share ({type(err).__name__}: {err}): "
                f"make room in {window_backing_directory()} or point {BACKING_DIRECTORY_KNOB} at a directory with room"
            )
        # Every rank of the job hears of a failure on any node before anything waits on the buffers.
        failed = comm.allreduce(rank if error is not None else comm.Get_size(), op=MPI.MIN)
        if failed < comm.Get_size():
            raise RuntimeError(comm.bcast(error, root=failed))
        if array is not None:
            return array
        self._window.Fence()
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        memory, _ = self._window.Shared_query(holder)
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)

    def share(self) -> None:
        """Copy root's bytes into every node's buffer (collective)."""

        def body() -> None:
            if self._across is not None and self._across.Get_size() > 1:
                for piece in for_each_piece(self.array):
                    self._across.Bcast(piece, root=0)
            if self._node is not None:
                for piece in for_each_piece(self.array):
                    self._node.Bcast(piece, root=self._holder)
            else:
                self._window.Fence()  # the holder's writes are visible to its node from here on

        self._comm.run(self._comm.plan_shared_bytes(body, self._root))

    def close(self) -> None:
        """Release the window and the communicator between nodes (collective); ``array`` is gone after."""
        if self._window is None and self._across is None and self._node is None:
            return
        window, across, self._window, self._across, self._node = self._window, self._across, None, None, None
        self.array = np.empty(0, dtype=np.uint8)

        def body() -> None:
            if window is not None:
                window.Free()
            if across is not None:
                across.Free()

        self._comm.run(self._comm.plan_shared_bytes(body, self._root))
