"""What a process finds around it: where its ranks come from, its settings, network and MPI.

One class per launch environment (``mpi``, ``slurm``, ``torchrun``, ``single``), picked by
``detect_environment``; ``torchrun.launcher_variables`` gives torchrun's variables to
ranks that mpirun or srun started; ``settings`` reads the HPCDDP_* variables, ``network`` the
interfaces and addresses, ``mpi_import`` imports mpi4py with the thread level hpcddp
needs, and ``files`` writes files atomically. Nothing here imports the rest of hpcddp.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import ClusterEnvironment, RankLayout, Rendezvous, read_int
from .mpi import MPIEnvironment
from .single import SingleProcessEnvironment
from .slurm import SlurmEnvironment, expand_nodelist
from .torchrun import TorchrunEnvironment

__all__ = [
    "ClusterEnvironment",
    "MPIEnvironment",
    "RankLayout",
    "Rendezvous",
    "SingleProcessEnvironment",
    "SlurmEnvironment",
    "TorchrunEnvironment",
    "detect_environment",
    "expand_nodelist",
    "read_int",
]

# Order matters: mpirun inside an sbatch allocation also sees SLURM_* variables, so
# MPI (the ranks really connected) is asked first; srun singletons come before
# torchrun because hpcddp itself exports RANK/WORLD_SIZE for child processes; a
# single process is the fallback that always applies.
ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    MPIEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    SingleProcessEnvironment,
)


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Return the first environment in ``ENVIRONMENTS`` that applies to this process.

    Args:
        environ: the environment to inspect; ``os.environ`` by default.
    """
    environ = os.environ if environ is None else environ
    for cls in ENVIRONMENTS:
        if cls.detect(environ):
            return cls(environ)
    raise AssertionError("SingleProcessEnvironment always applies")
