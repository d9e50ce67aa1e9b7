"""init() under mpirun, on one host or across nodes: distinct ranks, the node layout, exported variables.

The reference layout comes from every rank's host name, gathered with plain mpi4py:
the ranks of a host form a node, nodes are numbered in the order of their first rank.
Across the virtual cluster (tests/test_multinode.py) HPCDDP_EXPECT_NODES says how many
nodes the job must span and HPCDDP_BACKEND which backend hpcddp must use.
"""

import ipaddress
import os
import socket

import torch
from mpi4py import MPI

import hpcddp
import hpcddp.horovod as hvd
from hpcddp.env.network import list_interfaces


def reference_layout():
    hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    me = MPI.COMM_WORLD.Get_rank()
    nodes = list(dict.fromkeys(hosts))
    mine = hosts[me]
    return {
        "local_rank": hosts[:me].count(mine),
        "local_size": hosts.count(mine),
        "node_rank": nodes.index(mine),
        "num_nodes": len(nodes),
    }


def test_ranks_are_distinct_and_complete():
    ranks = hpcddp.allgather_object(hpcddp.rank())
    assert ranks == list(range(hpcddp.size()))
    assert hpcddp.size() == int(os.environ["OMPI_COMM_WORLD_SIZE"]) == MPI.COMM_WORLD.Get_size()
    assert hpcddp.rank() == MPI.COMM_WORLD.Get_rank()


def test_node_layout_follows_the_hosts():
    expected = reference_layout()
    layout = {
        "local_rank": hpcddp.local_rank(),
        "local_size": hpcddp.local_size(),
        "node_rank": hpcddp.node_rank(),
        "num_nodes": hpcddp.num_nodes(),
    }
    assert layout == expected
    if os.environ.get("HPCDDP_EXPECT_NODES"):
        assert hpcddp.num_nodes() == int(os.environ["HPCDDP_EXPECT_NODES"])


def test_horovod_cross_rank_counts_nodes():
    # Horovod: the ranks with this local rank form the cross communicator, one per node.
    expected = reference_layout()
    assert (hvd.local_rank(), hvd.local_size()) == (expected["local_rank"], expected["local_size"])
    assert (hvd.cross_rank(), hvd.cross_size()) == (expected["node_rank"], expected["num_nodes"])


def test_backend_and_device():
    assert hpcddp.backend() == os.environ.get("HPCDDP_BACKEND", "mpi")
    assert hpcddp.device() == torch.device("cpu")


def test_torchrun_variables_exported_and_agreed():
    expected = reference_layout()
    assert os.environ["RANK"] == str(hpcddp.rank())
    assert os.environ["WORLD_SIZE"] == str(hpcddp.size())
    assert os.environ["LOCAL_RANK"] == str(expected["local_rank"])
    assert os.environ["LOCAL_WORLD_SIZE"] == str(expected["local_size"])
    assert os.environ["NODE_RANK"] == str(expected["node_rank"])
    rendezvous = hpcddp.allgather_object((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
    assert len(set(rendezvous)) == 1


def test_rendezvous_is_an_address_of_rank_0_that_every_rank_reaches_without_dns():
    address = ipaddress.IPv4Address(os.environ["MASTER_ADDR"])  # an IP, never a host name
    owners = hpcddp.allgather_object([i.address for i in list_interfaces()])
    if hpcddp.num_nodes() == 1:
        assert address.is_loopback
    else:
        assert str(address) in owners[0] and not address.is_loopback
    # gloo and NCCL leave through an interface of this rank that shares the address's subnet.
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    assert os.environ["NCCL_SOCKET_IFNAME"] == interface
    mine = next(i for i in list_interfaces() if i.name == interface)
    assert address in mine.network or address == ipaddress.IPv4Address(mine.address)


def test_init_twice_is_a_no_op():
    comm = hpcddp.communicator()
    hpcddp.init()
    assert hpcddp.communicator() is comm
