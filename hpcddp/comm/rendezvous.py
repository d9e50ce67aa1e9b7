"""Start torch.distributed's default group at the rendezvous ``hpcddp.init()`` exported.

torch.distributed on its own waits out its whole timeout (and prints C++ frames)
when a node cannot reach rank 0's store. Here rank 0 opens the store first and
every other rank checks within seconds, in plain Python, that it can reach it;
the ranks that cannot say so in one line each (and, when MPI connects the ranks,
every rank ends with them) before torch.distributed is asked to connect.

Under torchrun the agent serves the store and the group is made with torch's own
env:// (``join_through_env``). ``made_default_group`` tells a script's second
``init_process_group`` from its first.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import threading
import weakref

import torch
import torch.distributed as dist

from ..env.network import describe_interfaces, list_interfaces, probe_tcp
from .base import ranks_text

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DEFAULT_GROUP_LOCK",
    "connect_store",
    "join_process_group",
    "join_through_env",
    "made_default_group",
]

#: seconds a rank may take to reach rank 0's store before the job fails
CONNECT_TIMEOUT_S = 10.0

_made: weakref.ref | None = None  # the default group hpcddp made (weak: the script may destroy it)

#: held while the default group is made, by hpcddp's first collective under torchrun or by the
#: script's init_process_group: one of them makes it, the other then finds it (never two groups).
DEFAULT_GROUP_LOCK = threading.RLock()


def made_default_group() -> bool:
    """Return True when torch.distributed's default group exists and hpcddp made it (not the script)."""
    return dist.is_initialized() and _made is not None and _made() is dist.group.WORLD


def _remember_default_group() -> None:
    global _made
    _made = weakref.ref(dist.group.WORLD)


def join_through_env(
    backend: str, rank: int, world_size: int, *, timeout_s: float = 1800, device: torch.device | None = None
) -> None:
    """Make torch.distributed's default group with torch's own env:// rendezvous.

    Under torchrun the agent already serves the TCPStore at MASTER_PORT and every
    worker connects to it as a client (TORCHELASTIC_USE_AGENT_STORE=True), which
    env:// honours; hpcddp's own store (``join_process_group``) would try to serve
    that port a second time.

    Args:
        backend: "gloo" or "nccl".
        rank: this process's rank.
        world_size: the number of ranks.
        timeout_s: how long a collective may wait (torch.distributed's timeout).
        device: for nccl, this rank's GPU (binds the communicator to it).
    """
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if backend == "nccl" and device is not None else {}),
    )
    _remember_default_group()


def join_process_group(
    backend: str,
    rank: int,
    world_size: int,
    *,
    timeout_s: float = 1800,
    device: torch.device | None = None,
    mpi_comm=None,
) -> None:
    """Make torch.distributed's default group at the MASTER_ADDR/MASTER_PORT ``hpcddp.init()`` exported.

    Args:
        backend: "gloo" or "nccl".
        rank: this process's rank.
        world_size: the number of ranks.
        timeout_s: how long a collective may wait (torch.distributed's timeout).
        device: for nccl, this rank's GPU (binds the communicator to it).
        mpi_comm: the launcher's MPI communicator, if MPI connects the ranks: then
            every rank learns of an unreachable rendezvous and fails with it.
    """
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (address and port):
        raise RuntimeError(
            "MASTER_ADDR/MASTER_PORT are not set: call hpcddp.init() first (it exports them), or set both"
        )
    store = connect_store(address, int(port), rank, world_size, timeout_s=timeout_s, mpi_comm=mpi_comm)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if backend == "nccl" and device is not None else {}),
    )
    _remember_default_group()


def _serve_store(address: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's store, listening only on ``address`` when it is one of this node's addresses.

    The store accepts any client that reaches it (torch's TCPStore has no
    authentication): bound to the published address, it is not offered on the node's
    other networks. For an address that is not this node's (a MASTER_ADDR naming
    another interface, or a host name) it listens on every interface, and rank 0's
    own client goes through loopback, because torch retries a MASTER_ADDR that is not
    rank 0's for the whole timeout before the other ranks could report it in seconds.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(max(128, world_size))
    except OSError as err:
        listener.close()
        if err.errno != errno.EADDRNOTAVAIL and not isinstance(err, socket.gaierror):
            raise
        return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timeout, wait_for_workers=False)
    # The store owns the socket from here (detach: Python must not close it).
    return dist.TCPStore(
        address, port, world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def connect_store(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    timeout_s: float,
    mpi_comm=None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
) -> dist.TCPStore:
    """Return a TCPStore at ``address:port`` (rank 0 serves it), checking reachability first.

    Args:
        address: rank 0's address.
        port: the store's port.
        rank: this process's rank.
        world_size: the number of ranks.
        timeout_s: the store's timeout once connected.
        mpi_comm: an MPI communicator over the ranks, to fail together; None when
            the ranks cannot talk yet (srun without MPI, torchrun).
        connect_timeout: seconds to reach the store before failing.

    Raises:
        RuntimeError: one line naming the address, the interface and the fix.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store, error = None, None
    if rank == 0:
        try:
            store = _serve_store(address, port, world_size, timeout)
        except (RuntimeError, OSError) as err:
            error = (
                f"rank 0 ({socket.gethostname()}) cannot serve the rendezvous on port {port} "
                f"({str(err).splitlines()[0]}): set MASTER_PORT to a free port, or unset it to let hpcddp pick one"
            )
    else:
        failure = probe_tcp(address, port, connect_timeout)
        if failure is not None:
            error = _unreachable(rank, address, port, connect_timeout, failure)
    if mpi_comm is not None:
        failed = [r for r, e in enumerate(mpi_comm.allgather(error)) if e]
        if failed and error is None:
            error = (
                f"rank {rank}: the rendezvous at {address}:{port} failed on {ranks_text(failed)}; "
                "their lines say why and what to change"
            )
    if error is not None:
        raise RuntimeError(error)
    if store is None:
        store = dist.TCPStore(address, port, world_size, False, timeout=timeout)
    return store


def _unreachable(rank: int, address: str, port: int, waited: float, failure: str) -> str:
    interface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME") or "no named interface"
    return (
        f"rank {rank} ({socket.gethostname()}) cannot reach the rendezvous {address}:{port} through {interface} "
        f"within {waited:g} s ({failure}): set HPCDDP_IFACE (or init(interface=)) to the interface that connects "
        f"the nodes (this node has {describe_interfaces(list_interfaces())}), or MASTER_ADDR to an address of "
        "rank 0 that this node reaches"
    )
