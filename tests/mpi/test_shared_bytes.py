"""Communicator.share_bytes: root's bytes on every rank, one buffer per node on MPI (the test lays out nodes)."""

import numpy as np
import pytest

import hpcddp.comm.base as base
import hpcddp.comm.mpi.shared_window as shared_window
from hpcddp.comm.mpi import MPICommunicator
from hpcddp.env.mpi_import import import_mpi


def reference(nbytes):
    return np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)


def fill_on_root_and_check(shared, is_root, nbytes):
    """The root writes the reference bytes, shares them, and every rank reads exactly them."""
    if is_root:
        shared.array[:] = reference(nbytes)
    shared.share()
    np.testing.assert_array_equal(shared.array, reference(nbytes))


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
    monkeypatch.setattr(shared_window, "for_each_piece", lambda a: [a[i : i + 1000] for i in range(0, len(a), 1000)])
    nbytes = 4321
    try:
        with comm.share_bytes(nbytes, root) as shared:
            fill_on_root_and_check(shared, comm.rank == root, nbytes)
            # One buffer per node: what its first rank writes, the node's other ranks read.
            node.Barrier()
            if node.Get_rank() == 0:
                shared.array[:8] = 0
            node.Barrier()
            assert shared.array[:8].tolist() == [0] * 8
    finally:
        node.Free()


def test_private_buffers_are_filled_in_pieces_by_broadcasts(comm, monkeypatch):
    monkeypatch.setattr(base, "MESSAGE_PIECE_BYTES", 1000)
    root = comm.size - 1
    with base.PrivateBytes(comm, 4321, root) as shared:
        fill_on_root_and_check(shared, comm.rank == root, 4321)


def test_an_empty_buffer_is_shared_too(comm):
    with comm.share_bytes(0, 0) as shared:
        shared.share()
        assert shared.array.size == 0


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_without_room_for_a_window_each_rank_gets_its_own_copy_and_one_warning_per_node(
    comm, monkeypatch, caplog, ranks_per_node
):
    node = comm.mpi_comm.Split(comm.rank // ranks_per_node, comm.rank)
    monkeypatch.setattr(comm, "node_comm", lambda: node)
    monkeypatch.delenv("OMPI_MCA_osc_sm_backing_directory", raising=False)
    monkeypatch.setattr(shared_window, "free_bytes", lambda directory: 1000)  # e.g. Docker's 64 MB /dev/shm
    monkeypatch.setattr(shared_window, "allocate_window", lambda *args: pytest.fail("a window without room"))
    monkeypatch.setattr(shared_window, "for_each_piece", lambda a: [a[i : i + 1000] for i in range(0, len(a), 1000)])
    nbytes, root = 4321, comm.size - 1
    try:
        with comm.share_bytes(nbytes, root) as shared:
            fill_on_root_and_check(shared, comm.rank == root, nbytes)
            node.Barrier()
            if node.Get_rank() == 0:
                shared.array[:8] = 0
            node.Barrier()
            assert shared.array[:8].tolist() == ([0] * 8 if node.Get_rank() == 0 else reference(8).tolist())
    finally:
        node.Free()
    warnings = [r.getMessage() for r in caplog.records if "do not fit" in r.getMessage()]
    first_of_node = comm.rank // ranks_per_node * ranks_per_node
    holder = root if root // ranks_per_node == comm.rank // ranks_per_node else first_of_node
    assert len(warnings) == (1 if comm.rank == holder else 0)
    if warnings:  # the size, the directory and Open MPI's knob that moves it
        assert warnings[0].startswith("hpcddp: 0.0 MiB (4321 bytes) do not fit in the 0.0 MiB free in /dev/shm")
        assert "OMPI_MCA_osc_sm_backing_directory" in warnings[0]


def test_a_window_that_fails_on_one_rank_fails_on_every_rank(comm, monkeypatch):
    MPI = import_mpi()

    def allocate(MPI, nbytes, node):
        window = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
        if comm.rank == comm.size - 1:  # e.g. MPI_ERR_INTERN past the part of it that waits for the others
            raise MPI.Exception(MPI.ERR_OTHER)
        return window

    monkeypatch.setattr(shared_window, "allocate_window", allocate)
    with pytest.raises(
        RuntimeError, match=rf"rank {comm.size - 1} could not allocate 0.0 MiB to share .*MPI_ERR_OTHER"
    ):
        comm.share_bytes(4321, 0)
    assert MPI.COMM_WORLD.allreduce(1) == comm.size  # nobody is left waiting
