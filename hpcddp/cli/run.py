"""`hpcddp run`: start a script on N ranks through mpirun, or srun inside a Slurm allocation."""

from __future__ import annotations

import difflib
import os
import shlex
import shutil
import sys

import click

__all__ = ["run"]


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "-n",
    "-np",
    "--num-proc",
    "num_proc",
    type=int,
    help="Ranks to start, as mpirun's -n (default in Slurm: all tasks).",
)
@click.option("-H", "--hosts", help="Hosts and slots, e.g. node1:4,node2:4 (mpirun -H).")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False), help="An mpirun hostfile.")
@click.option(
    "--launcher",
    type=click.Choice(["auto", "mpirun", "srun"]),
    default="auto",
    show_default=True,
    help="auto: srun inside a Slurm allocation, else mpirun.",
)
@click.option(
    "-x",
    "--env",
    "env",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="Set or forward a variable on every rank (repeatable); HPCDDP_*, NCCL_*, OMP_*, PATH ... go anyway.",
)
@click.option("--min-np", type=int, help="Elastic: fewest ranks to go on with after hosts fail (default -np).")
@click.option(
    "--max-np", type=int, help="Elastic: most ranks to grow to when hosts come (default -np; all with discovery)."
)
@click.option(
    "--host-discovery-script",
    type=click.Path(exists=True, dir_okay=False),
    help="Elastic: a program printing the hosts available now, one host:slots a line (polled every second).",
)
@click.option("--reset-limit", type=int, help="Elastic: most restarts of the job (default no limit).")
@click.option(
    "--elastic-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Elastic: seconds to wait for --min-np slots.",
)
@click.option("--no-bind", is_flag=True, help="Do not bind ranks to cores (single host).")
@click.option("--dry-run", is_flag=True, help="Print the command and exit.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    num_proc,
    hosts,
    hostfile,
    launcher,
    env,
    min_np,
    max_np,
    host_discovery_script,
    reset_limit,
    elastic_timeout,
    no_bind,
    dry_run,
    script,
    args,
) -> None:
    """Run SCRIPT [ARGS...] on every rank and exit with the job's exit code.

    SCRIPT is a Python file (run with this Python) or any command:

    \b
      hpcddp run -np 4 train.py --epochs 5
      hpcddp run -np 8 -H node1:4,node2:4 train.py
      hpcddp run --dry-run -np 2 hpcddp bench train

    Through mpirun it adds what this machine needs: --allow-run-as-root as root,
    --oversubscribe with yield-when-idle when ranks outnumber cores, and on one host
    binds each rank to cores // ranks cores (hpcddp.init() uses them as threads).
    Signals (TERM, USR1, ...) are passed on to every rank; the exit code is the
    job's: 130 after Ctrl-C, and 1 when ranks were lost although mpirun claims 0.

    With --min-np, --max-np or --host-discovery-script the job is elastic (Horovod's
    hvd.elastic API): when a rank or a node is lost the job starts again on the hosts
    left, from the last commit, and it grows back when hosts return.
    """
    from .launch import LaunchConfig, build_launch_command, oversubscription, program_command

    if script.startswith("-"):
        _no_such_option(script)
    elastic = min_np is not None or max_np is not None or host_discovery_script is not None
    try:
        config = LaunchConfig(
            num_proc=num_proc, hosts=hosts, hostfile=hostfile, launcher=launcher, env=env, bind=not no_bind
        )
        if not elastic:
            command, environ = build_launch_command(config, program_command(script, args))
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    except FileNotFoundError as err:
        raise click.ClickException(str(err)) from None
    _check_program(script)
    if elastic:
        if dry_run:
            raise click.UsageError("--dry-run shows one launch; an elastic job has many: drop --dry-run")
        from .elastic import run_elastic

        sys.exit(
            run_elastic(
                num_proc=num_proc,
                min_np=min_np,
                max_np=max_np,
                host_discovery_script=host_discovery_script,
                reset_limit=reset_limit,
                elastic_timeout=elastic_timeout,
                hosts=hosts,
                hostfile=hostfile,
                launcher=launcher,
                env=env,
                program=program_command(script, args),
            )
        )
    ranks_and_cpus = oversubscription(command)
    if ranks_and_cpus:
        num_ranks, cpus = ranks_and_cpus
        click.echo(
            f"[hpcddp run] {num_ranks} ranks on {cpus} cores: oversubscribing (each rank yields its core while it waits)",
            err=True,
        )
    if dry_run:
        click.echo(shlex.join(command))
        return
    from ..fault.supervise import supervise

    sys.exit(supervise(command, environ))


def _no_such_option(arg: str) -> None:
    """Fail on ARG, an option run does not have, suggesting the closest of run's own options.

    ignore_unknown_options (there so that the program's options after SCRIPT reach it
    untouched) also keeps click's parser from raising its NoSuchOption, with the
    "Did you mean" list, for a mistyped option before SCRIPT: that arrives here as SCRIPT.
    """
    name = arg.split("=", 1)[0]
    ctx = click.get_current_context()
    options = [opt for param in ctx.command.get_params(ctx) if isinstance(param, click.Option) for opt in param.opts]
    raise click.NoSuchOption(
        name, message=f"no such option: {name}", possibilities=difflib.get_close_matches(name, options), ctx=ctx
    )


def _check_program(script: str) -> None:
    """Fail before the launcher starts (and prints a page of its own) when SCRIPT is not there."""
    if script.endswith(".py"):
        if not os.path.isfile(script):
            raise click.BadParameter(f"{script} does not exist (in {os.getcwd()}): check the path", param_hint="SCRIPT")
    elif os.sep not in script and shutil.which(script) is None:
        raise click.BadParameter(f"command {script!r} not found on PATH", param_hint="SCRIPT")
    elif os.sep in script and not os.access(script, os.X_OK):
        raise click.BadParameter(f"{script} is not an executable file: check the path", param_hint="SCRIPT")
