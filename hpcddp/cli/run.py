"""`hpcddp run` (not implemented yet)."""

import click

__all__ = ["run"]


@click.command()
def run() -> None:
    """Not implemented yet."""
    raise click.UsageError("hpcddp run is not implemented yet")
