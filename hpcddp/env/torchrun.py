"""Processes started by torchrun (or anything that sets its variables)."""

from __future__ import annotations

from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .network import interface_towards, list_interfaces

__all__ = ["TorchrunEnvironment"]


class TorchrunEnvironment(ClusterEnvironment):
    """Rank layout from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK."""

    name = "torchrun"

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
