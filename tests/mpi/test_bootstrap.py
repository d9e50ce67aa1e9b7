"""init() under mpirun, on one host or across nodes: distinct ranks, the node layout, exported variables.

The reference layout comes from every rank's host name, gathered with plain mpi4py:
the ranks of a host form a node, nodes are numbered in the order of their first rank.
Across the virtual cluster (tests/test_multinode.py) HPCDDP_EXPECT_NODES says how many
nodes the job must span and HPCDDP_BACKEND which backend hpcddp must use.
"""

import ipaddress
import os
import pickle
import socket

import pytest
import torch
from mpi4py import MPI

import hpcddp
import hpcddp.horovod as hvd
from hpcddp.env.mpi import MPIEnvironment
from hpcddp.env.network import Interface, list_interfaces


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


class CountingComm:
    """COMM_WORLD, counting the pickled bytes its object collectives bring this rank from the others."""

    def __init__(self):
        self.comm, self.received = MPI.COMM_WORLD, 0

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def _count(self, objects, sender_of):
        self.received += sum(len(pickle.dumps(x, pickle.HIGHEST_PROTOCOL)) for r, x in sender_of(objects))

    def allgather(self, obj):
        out = self.comm.allgather(obj)
        self._count(out, lambda xs: ((r, x) for r, x in enumerate(xs) if r != self.comm.Get_rank()))
        return out

    def gather(self, obj, root=0):
        out = self.comm.gather(obj, root=root)
        if out is not None:
            self._count(out, lambda xs: ((r, x) for r, x in enumerate(xs) if r != root))
        return out

    def bcast(self, obj, root=0):
        out = self.comm.bcast(obj, root=root)
        if self.comm.Get_rank() != root:
            self._count([out], enumerate)
        return out


def test_only_rank_0_receives_the_ranks_interfaces():
    comm = CountingComm()
    environment = MPIEnvironment({}, comm=comm)
    rendezvous = environment.rendezvous()
    assert len(set(MPI.COMM_WORLD.allgather((rendezvous.address, rendezvous.port)))) == 1
    one_rank = len(pickle.dumps((environment.layout().node_rank, socket.gethostname(), list_interfaces())))
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert comm.received >= (MPI.COMM_WORLD.Get_size() - 1) * one_rank * 0.9
    else:  # the decision only: (address, port, no error)
        assert comm.received < one_rank, f"rank received {comm.received} bytes; one rank's interfaces are {one_rank}"


def test_a_named_interface_missing_on_one_rank_fails_on_every_rank_naming_it(monkeypatch):
    named = "hpcddp-test0"
    if MPI.COMM_WORLD.Get_rank() != 1:  # every rank but 1 has it
        fake = Interface(named, "192.0.2.1", "255.255.255.0")
        monkeypatch.setattr("hpcddp.env.mpi.list_interfaces", lambda: [*list_interfaces(), fake])
    with pytest.raises(
        ValueError, match=rf"interface '{named}' \(HPCDDP_IFACE or init\(interface=\)\) does not exist on rank 1 \("
    ):
        MPIEnvironment({}, comm=MPI.COMM_WORLD).rendezvous(named)


def test_init_twice_is_a_no_op():
    comm = hpcddp.communicator()
    hpcddp.init()
    assert hpcddp.communicator() is comm


def test_any_error_of_rank_0s_rendezvous_fails_on_every_rank(monkeypatch):
    def no_port():
        raise OSError(98, "Address already in use")

    if MPI.COMM_WORLD.Get_rank() == 0:  # before the fix the other ranks waited in bcast forever
        monkeypatch.setattr("hpcddp.env.mpi.find_free_port", no_port)
    with pytest.raises(
        RuntimeError, match=r"rank 0 could not choose the rendezvous: OSError: .*Address already in use"
    ):
        MPIEnvironment({}, comm=MPI.COMM_WORLD).rendezvous()
