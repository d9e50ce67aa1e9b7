"""A plain ``python train.py``: one process, no launcher."""

from __future__ import annotations

from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout
from .mpi import find_free_port

__all__ = ["SingleProcessEnvironment"]


class SingleProcessEnvironment(ClusterEnvironment):
    """World of one; always applies, so it comes last in the detection order."""

    name = "single"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    def layout(self) -> RankLayout:
        return RankLayout(rank=0, world_size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1)

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", find_free_port()
