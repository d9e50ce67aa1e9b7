"""Ranks started by an MPI launcher (mpirun, mpiexec, srun --mpi=pmix)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .launcher import announced_ranks
from .mpi_import import import_mpi, mpi_launcher_present
from .network import (
    choose_rendezvous_interface,
    describe_interfaces,
    find_interface,
    interface_towards,
    list_interfaces,
    socket_ifname_hint,
)

__all__ = [
    "MPIEnvironment",
    "announced_ranks",
    "check_launcher_agrees",
    "find_free_port",
    "node_order_key",
    "singleton_under_slurm",
]


def find_free_port() -> int:
    """Return a TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_order_key(environ: Mapping[str, str], comm) -> int:
    """Return the key that orders ``comm``'s ranks within their node: the launcher's local rank, else the rank.

    A rank's Python learns LOCAL_RANK from the launcher before MPI starts (torchrun's
    variables, exported before the script), and scripts pick their GPU from it. Open MPI 5
    does not number a node's ranks in rank order when it oversubscribes (``mpirun -np 4
    --oversubscribe`` on two cores: ranks 1 and 2 get local ranks 2 and 1), so splitting the
    node by rank would give a rank another local rank, and another device, than its script chose.

    Local: each rank decides alone, and never raises (the split that uses the key is collective:
    a rank that raised before it would leave the others waiting there). A launcher variable that
    is no number, out of its range, or for another communicator than the job's leaves rank order.

    Args:
        environ: the environment to read.
        comm: the mpi4py communicator being split; the launcher's numbers hold only for the whole job.
    """
    try:
        announced = announced_ranks(environ)
    except ValueError:  # not a number: the start-up hook said so already
        announced = None
    if announced is None:
        return comm.Get_rank()
    rank, size, local_rank, local_size = announced
    if (rank, size) != (comm.Get_rank(), comm.Get_size()) or not 0 <= local_rank < local_size:
        return comm.Get_rank()
    MPI = import_mpi()
    if MPI.Comm.Compare(comm, MPI.COMM_WORLD) not in (MPI.IDENT, MPI.CONGRUENT):
        return comm.Get_rank()  # the same size, another order: the launcher numbered the job's ranks
    return local_rank


def singleton_under_slurm(environ: Mapping[str, str], mpi_size: int) -> bool:
    """Return True when srun started several tasks that MPI does not connect."""
    step_tasks = read_int(environ, "SLURM_STEP_NUM_TASKS") or read_int(environ, "SLURM_NTASKS") or 1
    return mpi_size == 1 and step_tasks > 1 and "SLURM_PROCID" in environ


def check_launcher_agrees(environ: Mapping[str, str], mpi_size: int) -> None:
    """Fail when the launcher's variables promise more ranks than MPI connects.

    Only "more" is an error: under mpirun across nodes the ranks inherit the
    variables of mpirun's per-node daemons (SLURM_STEP_NUM_TASKS = number of
    nodes), and hpcddp itself exports WORLD_SIZE for the processes it starts.

    Args:
        environ: the environment to check.
        mpi_size: the size of MPI_COMM_WORLD.
    """
    step_tasks = read_int(environ, "SLURM_STEP_NUM_TASKS")
    if step_tasks is not None and step_tasks > mpi_size and "SLURM_PROCID" in environ:
        raise RuntimeError(
            f"MPI connects {mpi_size} ranks but srun started {step_tasks} tasks (SLURM_STEP_NUM_TASKS={step_tasks}): "
            "launch with srun --mpi=pmix (see srun --mpi=list) or with mpirun, so that MPI sees every task"
        )
    world_size = read_int(environ, "WORLD_SIZE")
    if world_size is not None and world_size > mpi_size:
        raise RuntimeError(
            f"MPI started {mpi_size} ranks but WORLD_SIZE={world_size} is set: unset WORLD_SIZE (hpcddp sets it "
            f"from MPI) or start {world_size} ranks (mpirun -np {world_size})"
        )


class MPIEnvironment(ClusterEnvironment):
    """Rank layout from MPI itself: COMM_WORLD, and a shared-memory split for the node."""

    name = "mpi"

    def __init__(self, environ: Mapping[str, str] | None = None, comm=None) -> None:
        super().__init__(environ)
        MPI = import_mpi()
        self._comm = comm if comm is not None else MPI.COMM_WORLD
        self._layout: RankLayout | None = None

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        if not mpi_launcher_present(environ):
            return False
        # srun --mpi=pmi2 with an MPI that lacks PMI2 sets PMI_* but starts
        # singletons; that case belongs to SlurmEnvironment.
        return not singleton_under_slurm(environ, import_mpi().COMM_WORLD.Get_size())

    @property
    def mpi_comm(self):
        return self._comm

    def layout(self) -> RankLayout:
        if self._layout is None:
            check_launcher_agrees(self.environ, self._comm.Get_size())
            self._layout = self._compute_layout()
        return self._layout

    def _compute_layout(self) -> RankLayout:
        MPI = import_mpi()
        comm = self._comm
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=node_order_key(self.environ, comm))
        try:
            local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
            # The local leaders (local rank 0) number the nodes in rank order.
            leaders = comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=comm.Get_rank())
            if leaders != MPI.COMM_NULL:
                node_rank, num_nodes = leaders.Get_rank(), leaders.Get_size()
                leaders.Free()
            else:
                node_rank, num_nodes = 0, 0
            node_rank, num_nodes = node_comm.bcast((node_rank, num_nodes), root=0)
        finally:
            node_comm.Free()
        return RankLayout(
            rank=comm.Get_rank(),
            world_size=comm.Get_size(),
            local_rank=local_rank,
            local_size=local_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
        )

    def rendezvous(self, interface: str | None = None) -> Rendezvous:
        """Rank 0 picks an IP address every node reaches and a free port, and broadcasts them.

        Collective: rank 0 gathers every rank's interfaces (no host name is resolved)
        and broadcasts its decision or its error, so a named interface missing on any
        rank fails on every rank. Only rank 0 receives the interfaces: an allgather
        gave every rank all of them (p x ~0.5 KiB to each rank, 8.5 GiB moved at 4,096).
        """
        comm = self._comm
        own = list_interfaces()
        hint = interface or socket_ifname_hint(self.environ)
        peers = comm.gather((self.layout().node_rank, socket.gethostname(), own), root=0)
        decision = None
        if comm.Get_rank() == 0:
            try:
                decision = (*self._decide_rendezvous(peers, interface, hint), None)
            except Exception as err:  # raised below, on every rank: anything else would leave them in bcast
                ours = isinstance(err, (ValueError, RuntimeError))  # already one line naming the fix
                message = str(err) if ours else f"rank 0 could not choose the rendezvous: {type(err).__name__}: {err}"
                decision = (None, None, (isinstance(err, ValueError), message))
        address, port, error = comm.bcast(decision, root=0)
        if error is not None:
            bad_argument, message = error
            raise ValueError(message) if bad_argument else RuntimeError(message)
        chosen = interface_towards(address, interface, own) or (find_interface(own, hint) if hint else None)
        return Rendezvous(address, port, chosen.name if chosen else None, bool(interface))

    def _decide_rendezvous(self, peers, interface: str | None, hint: str | None) -> tuple[str, int]:
        """Rank 0: return (address, port) from every rank's (node, host, interfaces).

        Raises:
            ValueError: the named ``interface`` is missing on a rank, or is loopback across nodes.
            RuntimeError: no interface of rank 0 reaches the other nodes.
        """
        env, num_nodes = self.environ, self.layout().num_nodes
        _, own_host, own = peers[0]
        if interface:
            lacking = [
                f"rank {r} ({host})" for r, (_, host, ifs) in enumerate(peers) if not find_interface(ifs, interface)
            ]
            if lacking:
                raise ValueError(
                    f"interface {interface!r} (HPCDDP_IFACE or init(interface=)) does not exist on "
                    f"{', '.join(lacking)}: choose one that every node has (rank 0 has {describe_interfaces(own)})"
                )
            if find_interface(own, interface).is_loopback and num_nodes > 1:
                raise ValueError(
                    f"interface {interface!r} (HPCDDP_IFACE or init(interface=)) is loopback, but the job spans "
                    f"{num_nodes} nodes: choose one that connects them (rank 0 has {describe_interfaces(own)})"
                )
        port = read_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else find_free_port()
        if env.get("MASTER_ADDR"):
            return env["MASTER_ADDR"], port
        if num_nodes == 1:
            return "127.0.0.1", port
        if hint and find_interface(own, hint):
            return find_interface(own, hint).address, port
        first_of_node: dict[int, list] = {}
        for node, _, ifaces in peers:
            first_of_node.setdefault(node, ifaces)
        others = [ifaces for node, ifaces in first_of_node.items() if node != peers[0][0]]
        chosen = choose_rendezvous_interface(own, others)
        if chosen is None:
            raise RuntimeError(
                f"rank 0 ({own_host}) has no interface that the other nodes reach (it has "
                f"{describe_interfaces(own)}): set HPCDDP_IFACE to the interface that connects the nodes, "
                "or MASTER_ADDR to an address of rank 0's node that every node can reach"
            )
        return chosen.address, port
