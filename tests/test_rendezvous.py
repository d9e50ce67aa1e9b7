"""Rendezvous without DNS: which address rank 0 publishes, which interface gloo/NCCL use, and the
one-line failure when a rank cannot reach it (no MPI needed; tests/test_multinode.py does it on 2 nodes)."""

import logging
import socket
import subprocess
import sys
import time

import pytest

from hpcddp.env import slurm
from hpcddp.env.network import (
    Interface,
    choose_rendezvous_interface,
    interface_towards,
    list_interfaces,
    local_interface_for,
    socket_ifname_hint,
)
from hpcddp.env.settings import read_settings

from .conftest import ROOT

LO = Interface("lo", "127.0.0.1", "255.0.0.0")


@pytest.mark.unit
def test_this_host_has_loopback_and_it_reaches_itself():
    interfaces = list_interfaces()
    assert any(i.name == "lo" and i.address == "127.0.0.1" for i in interfaces), interfaces
    assert local_interface_for("127.0.0.1", interfaces).name == "lo"


@pytest.mark.unit
def test_rank_0_publishes_the_interface_every_node_shares_a_subnet_with():
    # eth0 is a management network only rank 0's node is on; ib0 connects all nodes.
    rank0 = [LO, Interface("eth0", "192.0.2.10", "255.255.255.0"), Interface("ib0", "10.1.0.1", "255.255.0.0")]
    others = [
        [LO, Interface("eth0", "198.51.100.7", "255.255.255.0"), Interface("ib0", "10.1.0.2", "255.255.0.0")],
        [LO, Interface("ib0", "10.1.3.9", "255.255.0.0")],
    ]
    assert choose_rendezvous_interface(rank0, others).name == "ib0"


@pytest.mark.unit
def test_without_a_shared_subnet_the_routing_table_decides(monkeypatch):
    rank0 = [LO, Interface("eth0", "192.0.2.10", "255.255.255.0"), Interface("eth1", "203.0.113.5", "255.255.255.0")]
    others = [[LO, Interface("eth0", "198.51.100.7", "255.255.255.0")]]
    monkeypatch.setattr("hpcddp.env.network._route_source", {"198.51.100.7": "203.0.113.5"}.get)
    assert choose_rendezvous_interface(rank0, others).name == "eth1"
    monkeypatch.setattr("hpcddp.env.network._route_source", lambda address: None)
    assert choose_rendezvous_interface(rank0, others) is None


@pytest.mark.unit
def test_a_named_interface_that_is_missing_names_those_there_are():
    interfaces = [LO, Interface("eth0", "10.213.0.12", "255.255.255.0")]
    with pytest.raises(ValueError) as error:
        interface_towards("10.213.0.11", "ib0", interfaces)
    message = str(error.value)
    assert message.startswith("interface 'ib0' (HPCDDP_IFACE or init(interface=)) does not exist on ")
    assert message.endswith("choose one of eth0 10.213.0.12/24")
    assert interface_towards("10.213.0.11", None, interfaces).name == "eth0"  # same subnet


@pytest.mark.unit
def test_gloo_and_nccl_interface_hints():
    assert socket_ifname_hint({"GLOO_SOCKET_IFNAME": "ib0"}) == "ib0"
    assert socket_ifname_hint({"NCCL_SOCKET_IFNAME": "^docker,lo"}) is None  # NCCL's prefix syntax
    assert socket_ifname_hint({}) is None


@pytest.mark.unit
def test_settings_read_the_interface_and_the_backend():
    assert read_settings({"HPCDDP_IFACE": "ib0", "HPCDDP_BACKEND": "GLOO"}) == {"interface": "ib0", "backend": "gloo"}


@pytest.mark.unit
def test_slurm_node_address_comes_from_scontrol_not_dns(monkeypatch):
    line = "NodeName=vnode1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.213.0.11 NodeHostName=vnode1 Version=22.05.8"
    monkeypatch.setattr(slurm.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, line, ""))
    assert slurm.node_address("vnode1") == "10.213.0.11"
    monkeypatch.setattr(slurm.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no node"))
    assert slurm.node_address("vnode1") == "vnode1"


@pytest.mark.unit
def test_exported_interface_follows_the_rendezvous_unless_the_user_set_one(monkeypatch, caplog):
    from hpcddp.env import Rendezvous
    from hpcddp.runtime.exports import export_rendezvous

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    export_rendezvous(Rendezvous("10.213.0.11", 4242, "eth0"))
    import os

    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth0", "eth0")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.213.0.11", "4242")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        export_rendezvous(Rendezvous("10.213.0.11", 4242, "ib0", interface_named=True))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"  # the user's choice stays
    assert "GLOO_SOCKET_IFNAME=eth1 differs from ib0 (HPCDDP_IFACE): keeping GLOO_SOCKET_IFNAME" in caplog.text


@pytest.mark.unit
def test_an_unreachable_rendezvous_is_one_line_within_seconds():
    from hpcddp.comm.rendezvous import connect_store

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        connect_store("127.0.0.1", port, rank=1, world_size=2, timeout_s=60, connect_timeout=1.5)
    assert time.monotonic() - started < 5
    message = str(error.value)
    assert "\n" not in message
    assert f"rank 1 ({socket.gethostname()}) cannot reach the rendezvous 127.0.0.1:{port} through " in message
    assert "within 1.5 s (Connection refused): set HPCDDP_IFACE (or init(interface=))" in message


@pytest.mark.ranks
def test_under_mpirun_every_rank_says_why_in_one_line(tmp_path):
    # Rank 0 cannot serve the store (its port is taken); every rank fails with one line.
    from hpcddp.testing import run_mpi

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        script = "import hpcddp; hpcddp.init(backend='gloo'); print('UNREACHABLE', flush=True)"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        result = run_mpi(2, [sys.executable, "-c", script], timeout=120, env=env, cwd=ROOT)
    finally:
        blocker.close()
    out = result.stdout
    assert result.returncode != 0 and "UNREACHABLE" not in out, out
    assert f"[hpcddp rank 0] error: rank 0 ({socket.gethostname()}) cannot serve the rendezvous on port {port}" in out
    assert "set MASTER_PORT to a free port, or unset it to let hpcddp pick one" in out
    assert f"[hpcddp rank 1] error: rank 1: the rendezvous at 127.0.0.1:{port} failed on rank 0; their lines" in out
    assert "Traceback" not in out and "frame #" not in out


def listening_addresses(port):
    """The local addresses a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    found = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.unit
def test_rank_0s_store_listens_only_on_the_published_address():
    from hpcddp.comm.rendezvous import connect_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = connect_store("127.0.0.1", port, 0, 1, timeout_s=10)
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert listening_addresses(port) == ["127.0.0.1"]  # not 0.0.0.0: no other network sees it
