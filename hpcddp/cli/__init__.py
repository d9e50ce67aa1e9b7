"""The ``hpcddp`` command: run, info, bench, timeline."""

from __future__ import annotations

import click

from .. import __version__

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcddp")
def main() -> None:
    """Data-parallel PyTorch training on HPC machines over MPI."""


def _register() -> None:
    # Each command lives in its own module; heavy imports (torch, mpi4py) happen
    # inside the commands so `hpcddp --help` stays fast.
    from .bench import bench
    from .bench_straggler import straggler
    from .info import info
    from .run import run
    from .timeline import timeline

    bench.add_command(straggler)
    for command in (run, info, bench, timeline):
        main.add_command(command)


_register()
