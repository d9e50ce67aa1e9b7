"""Processes started by torchrun (or anything that sets its variables), and torchrun's variables
for processes that another launcher started."""

from __future__ import annotations

from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .launcher import launcher_variables, rank_variables
from .network import interface_towards, list_interfaces

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
    """Return the rank variables torchrun would give the process at ``layout`` (``launcher.rank_variables``).

    Args:
        layout: where the process sits in the job.
    """
    return rank_variables(
        layout.rank, layout.world_size, layout.local_rank, layout.local_size, layout.node_rank, layout.num_nodes
    )
