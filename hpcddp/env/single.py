"""A plain ``python train.py``: one process, no launcher."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .mpi import find_free_port
from .network import interface_towards, list_interfaces

__all__ = ["SingleProcessEnvironment"]

log = logging.getLogger("hpcddp")


class SingleProcessEnvironment(ClusterEnvironment):
    """World of one; always applies, so it comes last in the detection order."""

    name = "single"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    def layout(self) -> RankLayout:
        tasks = read_int(self.environ, "SLURM_NTASKS", 1) or 1
        if tasks > 1 and "SLURM_STEP_NUM_TASKS" not in self.environ:
            # The batch script ran python itself: one process of a job that asked for more.
            log.warning(
                "hpcddp: this Slurm job has SLURM_NTASKS=%d but this process runs alone (no srun or mpirun "
                "started it): launch with srun --mpi=pmix python ... or hpcddp run",
                tasks,
            )
        return RankLayout(rank=0, world_size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1)

    def rendezvous(self, interface: str | None = None) -> Rendezvous:
        chosen = interface_towards("127.0.0.1", interface, list_interfaces())
        return Rendezvous("127.0.0.1", find_free_port(), chosen.name if chosen else None, bool(interface))
