"""What a launcher tells each rank before MPI starts, and torchrun's variables made from it.

Runs at every rank's interpreter start under a plain mpirun or srun (the installed
``hpcddp-torchrun-env.pth``, before the script), so it imports nothing at module level:
``typing``, ``dataclasses`` or ``collections`` alone would cost that start milliseconds.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = [
    "announced_ranks",
    "check_numbers",
    "expand_tasks_per_node",
    "launcher_variables",
    "rank_variables",
    "read_int",
    "read_value",
    "slurm_step_numbers",
    "tasks_on_this_node",
]

# What MPI launchers tell each rank before MPI starts: (rank, size, local rank, local size).
# Open MPI's mpirun, MVAPICH, MPICH's Hydra and Intel MPI. None of them names the node's
# index (Open MPI's OMPI_COMM_WORLD_NODE_RANK is the rank among the node's processes).
_ANNOUNCED_RANKS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def read_value(environ: Mapping[str, str], name: str, convert: Callable[[str], object], expected: str, default=None):
    """Read and convert an environment variable, failing with a message that names it.

    Args:
        environ: the environment to read (``os.environ`` or a test's dict).
        name: the variable.
        convert: turns the text into the value; raises ValueError when it cannot.
        expected: what a valid value is, for the message ("an integer").
        default: returned when the variable is unset or empty.
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be {expected}, got {raw!r}") from None


def read_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """Read an integer environment variable; ``default`` when unset (see ``read_value``)."""
    return read_value(environ, name, int, "an integer", default)


def announced_ranks(environ: Mapping[str, str]) -> tuple[int, int, int, int] | None:
    """Return (rank, size, local rank, local size) as the MPI launcher announced them, without starting MPI.

    None when no launcher that announces all four started this process (srun names
    them in its own SLURM_* variables instead).

    Args:
        environ: the environment to read.
    """
    for names in _ANNOUNCED_RANKS:
        if all(environ.get(name, "").strip() for name in names):
            rank, size, local_rank, local_size = (read_int(environ, name) for name in names)
            return rank, size, local_rank, local_size
    return None


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` form, e.g. ``2(x3),1`` -> [2, 2, 2, 1] (up to a malformed part)."""
    import re

    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            break
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def tasks_on_this_node(env: Mapping[str, str], world_size: int, num_nodes: int) -> int:
    """Return how many tasks of this Slurm step run on this task's node."""
    counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    node = read_int(env, "SLURM_NODEID", 0)
    if node < len(counts):
        return counts[node]
    return max(1, world_size // max(1, num_nodes))


def slurm_step_numbers(env: Mapping[str, str]) -> tuple[int, int, int, int, int, int]:
    """Return (rank, size, local rank, local size, node, nodes) of this task of a Slurm step."""
    world_size = read_int(env, "SLURM_STEP_NUM_TASKS") or read_int(env, "SLURM_NTASKS", 1)
    num_nodes = read_int(env, "SLURM_STEP_NUM_NODES") or read_int(env, "SLURM_NNODES", 1)
    return (
        read_int(env, "SLURM_PROCID", 0),
        world_size,
        read_int(env, "SLURM_LOCALID", 0),
        tasks_on_this_node(env, world_size, num_nodes),
        read_int(env, "SLURM_NODEID", 0),
        num_nodes,
    )


def check_numbers(rank: int, size: int, local_rank: int, local_size: int, node: int, nodes: int) -> None:
    """Raise ValueError, naming the number, when a rank's place is outside its ranges."""
    for name, value, bound in (
        ("rank", rank, size),
        ("local_rank", local_rank, local_size),
        ("node_rank", node, nodes),
    ):
        if not 0 <= value < bound:
            raise ValueError(f"{name} must be in [0, {bound}), got {value}")


def rank_variables(rank: int, size: int, local_rank: int, local_size: int, node: int, nodes: int) -> dict[str, str]:
    """Return the rank variables torchrun would give this process (NODE_RANK too, as Lightning reads it).

    MASTER_ADDR/MASTER_PORT are the rendezvous's; torchrun's ROLE_* and TORCHELASTIC_*
    describe its agent, which no other launcher has.
    """
    check_numbers(rank, size, local_rank, local_size, node, nodes)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "NODE_RANK": str(node),
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
            return rank_variables(rank, size, local_rank, local_size, 0, 1)
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size),
        }
    # A job step (srun) sets SLURM_STEP_NUM_TASKS; the batch script's own step does not.
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        return rank_variables(*slurm_step_numbers(environ))
    return {}
