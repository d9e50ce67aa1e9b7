"""Communicator.share_bytes: root's bytes on every rank, one buffer per node on MPI (the test lays out nodes)."""

import numpy as np
import pytest

import hpcddp.comm.shared_bytes as shared_bytes
from hpcddp.comm.mpi import MPICommunicator
from hpcddp.env.mpi_import import import_mpi


def reference(nbytes):
    return np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def comm():
    made = MPICommunicator(import_mpi().COMM_WORLD)
    yield made
    made.close()


@pytest.mark.parametrize("ranks_per_node", [1, 2])
@pytest.mark.parametrize("root", ["first", "last"])
def test_roots_bytes_reach_every_rank_through_one_buffer_per_node(comm, monkeypatch, ranks_per_node, root):
    root = comm.size - 1 if root == "last" else 0  # "last": not its node's first rank when nodes hold 2
    node = comm.mpi_comm.Split(comm.rank // ranks_per_node, comm.rank)  # nodes of ranks_per_node ranks
    monkeypatch.setattr(comm, "node_comm", lambda: node)
    monkeypatch.setattr(shared_bytes, "for_each_piece", lambda a: [a[i : i + 1000] for i in range(0, len(a), 1000)])
    nbytes = 4321
    try:
        with comm.share_bytes(nbytes, root) as shared:
            if comm.rank == root:
                shared.array[:] = reference(nbytes)
            shared.share()
            np.testing.assert_array_equal(shared.array, reference(nbytes))
            # One buffer per node: what its first rank writes, the node's other ranks read.
            node.Barrier()
            if node.Get_rank() == 0:
                shared.array[:8] = 0
            node.Barrier()
            assert shared.array[:8].tolist() == [0] * 8
    finally:
        node.Free()


def test_private_buffers_are_filled_in_pieces_by_broadcasts(comm, monkeypatch):
    monkeypatch.setattr(shared_bytes, "MESSAGE_PIECE_BYTES", 1000)
    root = comm.size - 1
    with shared_bytes.PrivateBytes(comm, 4321, root) as shared:
        if comm.rank == root:
            shared.array[:] = reference(4321)
        shared.share()
        np.testing.assert_array_equal(shared.array, reference(4321))


def test_an_empty_buffer_is_shared_too(comm):
    with comm.share_bytes(0, 0) as shared:
        shared.share()
        assert shared.array.size == 0
