"""init() under mpirun: distinct ranks, a consistent node layout, exported variables."""

import os

import torch

import hpcddp


def test_ranks_are_distinct_and_complete():
    ranks = hpcddp.allgather_object(hpcddp.rank())
    assert ranks == list(range(hpcddp.size()))
    assert hpcddp.size() == int(os.environ["OMPI_COMM_WORLD_SIZE"])


def test_local_layout_on_one_host():
    assert hpcddp.num_nodes() == 1 and hpcddp.node_rank() == 0
    assert hpcddp.local_size() == hpcddp.size()
    assert hpcddp.local_rank() == hpcddp.rank()


def test_backend_and_device():
    assert hpcddp.backend() == "mpi"
    assert hpcddp.device() == torch.device("cpu")


def test_torchrun_variables_exported_and_agreed():
    assert os.environ["RANK"] == str(hpcddp.rank())
    assert os.environ["WORLD_SIZE"] == str(hpcddp.size())
    assert os.environ["LOCAL_RANK"] == str(hpcddp.local_rank())
    assert os.environ["LOCAL_WORLD_SIZE"] == str(hpcddp.local_size())
    assert os.environ["NODE_RANK"] == "0"
    rendezvous = hpcddp.allgather_object((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
    assert len(set(rendezvous)) == 1


def test_init_twice_is_a_no_op():
    comm = hpcddp.communicator()
    hpcddp.init()
    assert hpcddp.communicator() is comm
