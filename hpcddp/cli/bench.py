"""`hpcddp bench` (not implemented yet)."""

import click

__all__ = ["bench"]


@click.command()
def bench() -> None:
    """Not implemented yet."""
    raise click.UsageError("hpcddp bench is not implemented yet")
