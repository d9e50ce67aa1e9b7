"""`hpcddp info` (not implemented yet)."""

import click

__all__ = ["info"]


@click.command()
def info() -> None:
    """Not implemented yet."""
    raise click.UsageError("hpcddp info is not implemented yet")
