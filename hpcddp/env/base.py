"""The interface every launch environment implements."""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .launcher import check_numbers, read_int, read_value

__all__ = ["ClusterEnvironment", "RankLayout", "Rendezvous", "read_int", "read_value"]


@dataclass(frozen=True)
class RankLayout:
    """Where one process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int

    def __post_init__(self) -> None:
        check_numbers(self.rank, self.world_size, self.local_rank, self.local_size, self.node_rank, self.num_nodes)


@dataclass(frozen=True)
class Rendezvous:
    """Where torch.distributed's TCP store listens, and how this rank gets there."""

    address: str
    """An IP address of rank 0 (or the user's MASTER_ADDR)."""
    port: int
    interface: str | None = None
    """This rank's interface towards ``address``, for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME;
    None when it cannot be told (no route, or a MASTER_ADDR that does not resolve)."""
    interface_named: bool = False
    """The user chose the interface (HPCDDP_IFACE or ``init(interface=)``)."""


class ClusterEnvironment(abc.ABC):
    """One way of being launched (mpirun, srun, torchrun, plain python).

    Subclasses read the environment only in ``detect`` and ``__init__``; the rest of
    hpcddp asks them for the rank layout and, for torch.distributed backends, a
    rendezvous address.
    """

    #: short name shown by ``hpcddp info`` and in errors
    name: str = "abstract"
    #: the script makes torch.distributed's default group itself (torchrun: its agent serves
    #: the store); hpcddp joins it, and makes it only when it needs it first
    script_makes_process_group: bool = False

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = os.environ if environ is None else environ

    @staticmethod
    @abc.abstractmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """Return True when this process was started by this kind of launcher."""

    @abc.abstractmethod
    def layout(self) -> RankLayout:
        """Return this process's rank layout."""

    @property
    def mpi_comm(self):
        """The MPI communicator holding all ranks, or None if MPI does not see them."""
        return None

    @abc.abstractmethod
    def rendezvous(self, interface: str | None = None) -> Rendezvous:
        """Return the address and port every rank uses for torch.distributed's TCP store.

        Args:
            interface: the network interface the user chose (HPCDDP_IFACE or
                ``init(interface=)``); None picks one that reaches every node.
        """

    def away_from(self, rendezvous: Rendezvous, taken: set[int]) -> Rendezvous:
        """Return ``rendezvous`` off the ports in ``taken`` where this environment would choose one again.

        ``taken``: the ports earlier ``init()`` calls of this process chose, which their groups
        may still hold. Only an environment whose tasks derive the port alone moves; the others
        choose a free one afresh (rank 0 under MPI) or keep the user's or the launcher's.
        """
        return rendezvous
