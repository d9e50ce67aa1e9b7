"""Processes started by torchrun (or anything that sets its variables), and torchrun's variables
for processes that another launcher started."""

from __future__ import annotations

from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .mpi import announced_ranks
from .network import interface_towards, list_interfaces
from .slurm import SlurmEnvironment

__all__ = ["RANK_VARIABLES", "TorchrunEnvironment", "launcher_variables", "torchrun_variables"]


class TorchrunEnvironment(ClusterEnvironment):
    """Rank layout from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK."""

    name = "torchrun"
    # torchrun's agent serves the TCPStore at MASTER_PORT and tells the workers so
    # (TORCHELASTIC_USE_AGENT_STORE=True): a second store there fails, and scripts call
    # init_process_group themselves, which fails when a default group already exists.
    script_makes_process_group = True

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return bool(environ.get("RANK")) and bool(environ.get("WORLD_SIZE"))

    def layout(self) -> RankLayout:
        env = self.environ
        world_size = read_int(env, "WORLD_SIZE", 1)
        local_size = read_int(env, "LOCAL_WORLD_SIZE", world_size)
        return RankLayout(
            rank=read_int(env, "RANK", 0),
            world_size=world_size,
            local_rank=read_int(env, "LOCAL_RANK", 0),
            local_size=local_size,
            node_rank=read_int(env, "GROUP_RANK", None) or read_int(env, "NODE_RANK", 0),
            num_nodes=max(1, world_size // max(1, local_size)),
        )

    def rendezvous(self, interface: str | None = None) -> Rendezvous:
        env = self.environ
        address = env.get("MASTER_ADDR", "127.0.0.1")
        chosen = interface_towards(address, interface, list_interfaces())
        return Rendezvous(
            address, read_int(env, "MASTER_PORT", 29500), chosen.name if chosen else None, bool(interface)
        )


#: the per-rank variables torchrun gives each worker (a launcher starts its ranks without stale ones)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK")


def torchrun_variables(layout: RankLayout) -> dict[str, str]:
    """Return the rank variables torchrun would give the process at ``layout`` (NODE_RANK too, as Lightning reads it).

    MASTER_ADDR/MASTER_PORT are the rendezvous's, not the layout's; torchrun's ROLE_* and
    TORCHELASTIC_* describe its agent, which no other launcher has.

    Args:
        layout: where the process sits in the job.
    """
    return {
        "RANK": str(layout.rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_RANK": str(layout.local_rank),
        "LOCAL_WORLD_SIZE": str(layout.local_size),
        "GROUP_RANK": str(layout.node_rank),
        "GROUP_WORLD_SIZE": str(layout.num_nodes),
        "NODE_RANK": str(layout.node_rank),
    }


def launcher_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """Return torchrun's rank variables as this process's launcher (mpirun, mpiexec, srun) announced them.

    Read from the launcher's own variables, without starting MPI. {} when torchrun
    started the process (its variables already describe it) or no launcher did. Under an
    MPI launcher across nodes the node's index is not announced: GROUP_RANK, NODE_RANK and
    GROUP_WORLD_SIZE are left out until MPI tells them (``hpcddp.init()``).

    Args:
        environ: the environment to read.
    """
    if "TORCHELASTIC_RUN_ID" in environ:
        return {}
    # Open MPI's variables first: mpirun inside an sbatch allocation passes the batch
    # step's SLURM_* on to its ranks.
    ranks = announced_ranks(environ)
    if ranks is not None:
        rank, size, local_rank, local_size = ranks
        if local_size == size:  # one node: its index needs no asking
            return torchrun_variables(RankLayout(rank, size, local_rank, local_size, node_rank=0, num_nodes=1))
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size),
        }
    # A job step (srun) sets SLURM_STEP_NUM_TASKS; the batch script's own step does not.
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        return torchrun_variables(SlurmEnvironment(environ).layout())
    return {}
