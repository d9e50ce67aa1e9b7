"""Bytes each rank receives in the launch environment's start-up collectives (docs/BENCHMARKS.md).

    mpirun --allow-run-as-root --oversubscribe -np 4 python tests/tools/startup_bytes.py

Runs ``MPIEnvironment``'s layout and rendezvous (what ``hpcddp.init()`` does first, under
mpirun or srun --mpi=pmix) over a communicator that counts, per rank, the pickled bytes of
what the object collectives deliver to it from other ranks. Rank 0 prints every rank's
count, the pickled size b of one rank's (node, host, interfaces) and of rank 0's decision d,
and the totals an allgather (p (p - 1) b + (p - 1) d) and a gather (p - 1) (b + d) predict.
"""

import pickle
import socket

from hpcddp.env.mpi import MPIEnvironment
from hpcddp.env.mpi_import import import_mpi
from hpcddp.env.network import list_interfaces


def size_of(obj) -> int:
    return len(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))  # as mpi4py pickles


class CountingComm:
    """An mpi4py communicator that counts the pickled bytes its object collectives bring this rank."""

    def __init__(self, comm) -> None:
        self._comm, self.received = comm, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def allgather(self, obj):
        out = self._comm.allgather(obj)
        self.received += sum(size_of(x) for r, x in enumerate(out) if r != self._comm.Get_rank())
        return out

    def gather(self, obj, root=0):
        out = self._comm.gather(obj, root=root)
        if out is not None:
            self.received += sum(size_of(x) for r, x in enumerate(out) if r != root)
        return out

    def bcast(self, obj, root=0):
        out = self._comm.bcast(obj, root=root)
        if self._comm.Get_rank() != root:
            self.received += size_of(out)
        return out


def main() -> None:
    comm = CountingComm(import_mpi().COMM_WORLD)
    environment = MPIEnvironment({}, comm=comm)
    layout = environment.layout()
    rendezvous = environment.rendezvous()
    counts = comm._comm.gather(comm.received, root=0)
    own = size_of((layout.node_rank, socket.gethostname(), list_interfaces()))
    sizes = comm._comm.gather(own, root=0)
    if layout.rank == 0:
        p, b = layout.world_size, max(sizes)
        d = size_of((rendezvous.address, rendezvous.port, None))
        print(f"{p} ranks: received per rank {counts} bytes, total {sum(counts)}; b = {b}, d = {d} bytes")
        print(f"  allgather model p(p-1)b + (p-1)d = {p * (p - 1) * b + (p - 1) * d}; "
              f"gather model (p-1)(b+d) = {(p - 1) * (b + d)}")  # fmt: skip


if __name__ == "__main__":
    main()
