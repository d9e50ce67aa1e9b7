"""``hpcddp run --min-np``: the elastic options, turned into an ElasticDriver."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import click

from .driver import ElasticConfig, ElasticDriver
from .hosts import Host, HostPool, parse_hosts, read_hostfile, slurm_hosts
from .launchers import JobLauncher

__all__ = ["ELASTIC_OPTIONS", "run_elastic"]

#: the ``hpcddp run`` options that make a job elastic
ELASTIC_OPTIONS = ("min_np", "max_np", "host_discovery_script")


def run_elastic(
    *,
    num_proc: int | None,
    min_np: int | None,
    max_np: int | None,
    host_discovery_script: str | None,
    reset_limit: int | None,
    elastic_timeout: float,
    hosts: str | None,
    hostfile: str | None,
    launcher: str,
    env: Sequence[str],
    program: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``program`` as an elastic job and return its exit code (``hpcddp run``'s options, one to one)."""
    environ = dict(os.environ if environ is None else environ)
    in_slurm = bool(environ.get("SLURM_JOB_ID"))
    if launcher == "auto":
        launcher = "srun" if in_slurm and not (hosts or hostfile) else "mpirun"
    try:
        if min_np is not None and num_proc is not None and max_np is None and num_proc < min_np:
            raise ValueError(f"-np ({num_proc}) must be >= --min-np ({min_np}): -np is where the job starts")
        config = ElasticConfig(
            min_np=min_np if min_np is not None else (num_proc or 1),
            max_np=max_np if max_np is not None else (num_proc if host_discovery_script is None else None),
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
        )
        pool = HostPool(
            hosts=None if host_discovery_script else _fixed_hosts(hosts, hostfile, in_slurm, num_proc, environ),
            discovery_script=host_discovery_script,
        )
        single_host = not (host_discovery_script or hosts or hostfile or in_slurm)
        job_launcher = JobLauncher(launcher, env, environ, single_host=single_host)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    return ElasticDriver(config, pool, job_launcher, program).run()


def _fixed_hosts(
    hosts: str | None, hostfile: str | None, in_slurm: bool, num_proc: int | None, environ: Mapping[str, str]
) -> list[Host]:
    if hosts:
        return parse_hosts(hosts)
    if hostfile:
        return read_hostfile(hostfile)
    if in_slurm:
        return slurm_hosts(environ)
    if num_proc is None:
        raise ValueError("-np is required for an elastic job on this host alone: hpcddp run -np 4 --min-np 2 ...")
    # One host: a lost rank is started again here (this host passes its health check).
    return [Host("localhost", num_proc)]
