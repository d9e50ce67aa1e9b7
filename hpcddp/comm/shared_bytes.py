"""Bytes that one rank fills and every rank reads, with a buffer per rank (any backend).

    with comm.share_bytes(nbytes, root=0) as shared:   # collective
        if comm.rank == 0:
            fill(shared.array)                        # e.g. read a file into it
        shared.share()                                # collective: root's bytes everywhere
        use(shared.array)                             # read-only on every rank

Backends give each rank its own buffer and broadcast into it (``PrivateBytes``); MPI holds
the bytes once per node in a shared-memory window instead (``hpcddp.comm.mpi.shared_window``).
"""

from __future__ import annotations

import numpy as np
import torch

from .mpi.buffers import MESSAGE_PIECE_BYTES

__all__ = ["PrivateBytes"]


class PrivateBytes:
    """``nbytes`` bytes on every rank, filled by broadcasts of root's (any communicator).

    Args:
        comm: the ``Communicator`` (None: a world of one).
        nbytes: the buffer's size, the same on every rank.
        root: the rank that fills ``array`` before ``share()``.
    """

    def __init__(self, comm, nbytes: int, root: int) -> None:
        self._comm, self._root = comm, root
        #: the bytes (uint8); root writes them before ``share()``, every rank reads them after
        self.array = np.empty(nbytes, dtype=np.uint8)

    def share(self) -> None:
        """Copy root's ``array`` into every rank's (collective)."""
        if self._comm is None or self._comm.size == 1:
            return
        # In pieces: a GPU backend stages each piece on the device, not the whole buffer.
        for start in range(0, len(self.array), MESSAGE_PIECE_BYTES):
            piece = torch.from_numpy(self.array[start : start + MESSAGE_PIECE_BYTES])
            self._comm.broadcast_async_(piece, self._root).wait()

    def close(self) -> None:
        """Release the buffer (collective where the backend shares memory)."""
        self.array = np.empty(0, dtype=np.uint8)

    def __enter__(self) -> PrivateBytes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
