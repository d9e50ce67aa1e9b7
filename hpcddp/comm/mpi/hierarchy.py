"""Two-level allreduce for jobs that span nodes: reduce inside each node over shared
memory, allreduce between nodes, share the result inside the node.

A flat ring over 2 nodes x 2 ranks sends 1.5x the buffer over each node's link; this
sends 1x, and the rest moves through shared memory. Where the links between nodes
are the bottleneck, that is the whole difference (see docs/BENCHMARKS.md, "Across
nodes").
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["HIERARCHY_MIN_BYTES", "NodeHierarchy", "hierarchy_for", "pays_across"]

#: messages below this size take the flat allreduce: three steps cost more latency
#: than the link time they save
HIERARCHY_MIN_BYTES = 64 * 1024


class NodeHierarchy:
    """The communicators of a two-level allreduce over ``comm``.

    When every node holds the same number of ranks, each node's ranks reduce-scatter
    the buffer over shared memory, each rank allreduces its shard with the ranks of
    the same local rank on the other nodes (as many flows between nodes as ranks
    per node, each with 1/L of the buffer), and the node allgathers the shards. With
    uneven nodes, each node reduces to its first rank, those allreduce, and broadcast.

    Nodes are told apart by the processor name MPI reports (the host name), as the
    launchers place ranks; no name resolution is involved.

    Args:
        comm: the mpi4py communicator to split (collective over it).
        MPI: the mpi4py ``MPI`` module.
        hosts: the node of every rank, in rank order; the processor names by default
            (tests lay out nodes with it).
    """

    def __init__(self, comm, MPI, hosts: list[str] | None = None) -> None:
        rank = comm.Get_rank()
        hosts = hosts or comm.allgather(MPI.Get_processor_name())
        nodes = list(dict.fromkeys(hosts))
        self.num_nodes = len(nodes)
        self.ranks_per_node = [hosts.count(node) for node in nodes]
        self._MPI = MPI
        self.local = comm.Split(nodes.index(hosts[rank]), rank)
        self.sharded = len(set(self.ranks_per_node)) == 1
        # Sharded: ranks of one local rank across nodes; else: the first rank of each node.
        if self.sharded:
            self.across = comm.Split(self.local.Get_rank(), rank)
        else:
            self.across = comm.Split(0 if self.local.Get_rank() == 0 else MPI.UNDEFINED, rank)

    def allreduce(self, buffer: Any, op) -> None:
        """Reduce ``buffer`` (a numpy array, or ``[array, datatype]``) in place over all ranks."""
        array, datatype = (
            buffer if isinstance(buffer, list) else (buffer, self._MPI.Datatype.fromcode(buffer.dtype.char))
        )
        if self.sharded:
            self._sharded(array, datatype, op)
        else:
            self._through_leaders(array, datatype, op)

    def _sharded(self, array, datatype, op) -> None:
        size, me = self.local.Get_size(), self.local.Get_rank()
        counts = [len(array) // size + (i < len(array) % size) for i in range(size)]
        displacements = [sum(counts[:i]) for i in range(size)]
        shard = array[displacements[me] : displacements[me] + counts[me]].copy()
        self.local.Reduce_scatter([array, datatype], [shard, datatype], counts, op=op)
        self.across.Allreduce(self._MPI.IN_PLACE, [shard, datatype], op=op)
        self.local.Allgatherv([shard, datatype], [array, counts, displacements, datatype])

    def _through_leaders(self, array, datatype, op) -> None:
        MPI = self._MPI
        if self.local.Get_rank() == 0:
            self.local.Reduce(MPI.IN_PLACE, [array, datatype], op=op, root=0)
            self.across.Allreduce(MPI.IN_PLACE, [array, datatype], op=op)
        else:
            self.local.Reduce([array, datatype], None, op=op, root=0)
        self.local.Bcast([array, datatype], root=0)

    def free(self) -> None:
        """Release the communicators."""
        self.local.Free()
        if self.across != self._MPI.COMM_NULL:
            self.across.Free()


def pays_across(hosts: list[str]) -> bool:
    """Whether two levels can save anything: the ranks span several nodes and a node holds several.

    Args:
        hosts: the node of every rank, in rank order.
    """
    return 1 < len(set(hosts)) < len(hosts)


def _min_of(comm, MPI, code: int) -> tuple[int, int]:
    """(smallest, -largest) of every rank's ``code``, in one small allreduce."""
    both = np.array([code, -code], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MIN)
    return int(both[0]), int(both[1])


def hierarchy_for(comm, MPI, enabled: bool | str) -> NodeHierarchy | None:
    """Return the two-level scheme for ``comm`` when ``enabled`` (collective over ``comm``),
    else None: a flat allreduce.

    Args:
        comm: the mpi4py communicator.
        MPI: the mpi4py ``MPI`` module.
        enabled: whether to use it (``init(hierarchical_allreduce=)``): True, False, or
            "auto" (when ``pays_across`` the nodes; every rank sees the same hosts, so
            all decide alike).
    """
    if comm.Get_size() == 1:
        return None
    # Every rank takes part whatever its setting: ranks that disagree get one error, not a hang.
    code = {False: 0, True: 1, "auto": 2}[enabled]
    low, minus_high = _min_of(comm, MPI, code)
    if low != -minus_high:
        raise ValueError(
            "HPCDDP_HIERARCHICAL_ALLREDUCE (init(hierarchical_allreduce=)) differs between the ranks: give every "
            "rank the same value (export it before mpirun, or mpirun -x HPCDDP_HIERARCHICAL_ALLREDUCE)"
        )
    if not enabled:
        return None
    hosts = comm.allgather(MPI.Get_processor_name())
    if enabled == "auto" and not pays_across(hosts):
        return None
    return NodeHierarchy(comm, MPI, hosts)
