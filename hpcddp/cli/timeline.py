"""`hpcddp timeline merge`: make one Chrome trace of the per-rank event files a run left beside it."""

from __future__ import annotations

import click

__all__ = ["timeline"]


@click.group()
def timeline() -> None:
    """Work with the Chrome-trace timeline that HPCDDP_TIMELINE records."""


@timeline.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option(
    "--ranks",
    "num_ranks",
    type=click.IntRange(min=1),
    default=None,
    help="The run's number of ranks, to name those whose file is missing (default: up to the highest file found).",
)
@click.option("--keep", is_flag=True, help="Keep the per-rank files after a merge that found every rank.")
def merge(trace: str, num_ranks: int | None, keep: bool) -> None:
    """Write TRACE from the per-rank files in TRACE.ranks/ (rank-<r>.jsonl), reading what it can.

    Rank 0 does this at the end of a run; run it yourself when some ranks' files were on
    nodes rank 0 could not read: copy them into TRACE.ranks/ first.
    """
    from ..observe.merge import merge_rank_files, rank_directory

    try:
        result = merge_rank_files(trace, num_ranks, remove=not keep)
    except FileNotFoundError as err:
        raise click.UsageError(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"cannot write {trace}: {err}") from None
    click.echo(f"{trace}: events of {len(result.merged)} rank(s)")
    if result.missing:
        named = ", ".join(str(rank) for rank in result.missing[:16])
        more = f" and {len(result.missing) - 16} more" if len(result.missing) > 16 else ""
        click.echo(
            f"missing rank(s) {named}{more}: no readable rank-<r>.jsonl in {rank_directory(trace)} "
            "(copy them there from the nodes that wrote them and merge again)",
            err=True,
        )
        raise SystemExit(1)
