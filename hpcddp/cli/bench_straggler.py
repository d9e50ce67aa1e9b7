"""``hpcddp bench straggler``: time to a test accuracy with one slow rank (sync, local SGD, async averaging)."""

from __future__ import annotations

import importlib.util

import click

from .bench import PLOT_HINT, _echo, _fail_once, _finite, _output_path, _write_json, json_option

__all__ = ["straggler"]


@click.command()
@click.option(
    "--factor",
    default=3.0,
    show_default=True,
    type=click.FloatRange(min=1),
    callback=_finite,
    help="The last rank's pause after each step, as a multiple of the others' (1: no straggler).",
)
@click.option(
    "--pause-ms",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0),
    callback=_finite,
    help="The others' pause.",
)
@click.option(
    "--jitter-ms",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    callback=_finite,
    help="Random extra delay.",
)
@click.option(
    "--seconds",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    callback=_finite,
    help="Per run.",
)
@click.option("--target", default=0.95, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1), help="Runs of every variant.")
@click.option("--variants", default="sync,local-sgd,async", show_default=True, help="Comma-separated.")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1), help="Samples per rank.")
@click.option("--lr", default=0.1, show_default=True, type=click.FloatRange(min=0, min_open=True), callback=_finite)
@click.option(
    "--period", default=4, show_default=True, type=click.IntRange(min=1), help="local-sgd's averaging period."
)
@json_option
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, writable=True),
    callback=_output_path,
    help="Write the curves' PNG here.",
)
def straggler(
    factor, pause_ms, jitter_ms, seconds, target, repeats, variants, batch_size, lr, period, json_path, plot_path
):
    """Time to a test accuracy on digits with one slow rank: synchronous, local SGD, asynchronous averaging."""
    from ..bench.straggler import VARIANTS, StragglerConfig

    requested = tuple(v.strip() for v in variants.split(",") if v.strip())
    if not requested or any(v not in VARIANTS for v in requested):
        raise click.BadParameter(f"--variants must list names among {', '.join(VARIANTS)}, got {variants!r}")
    if importlib.util.find_spec("sklearn") is None:
        _fail_once("hpcddp bench straggler trains on scikit-learn's digits: pip install scikit-learn")
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        _fail_once(PLOT_HINT)
    config = StragglerConfig(
        variants=requested, factor=factor, pause_ms=pause_ms, jitter_ms=jitter_ms, seconds=seconds, target=target,
        repeats=repeats, batch_size=batch_size, lr=lr, period=period,
    )  # fmt: skip

    import hpcddp

    from ..bench.machine import describe_machine
    from ..bench.straggler import bench_straggler, summarize

    hpcddp.init(num_threads=1)
    _echo(
        f"# digits MLP, {hpcddp.size()} ranks, batch {batch_size}/rank, SGD lr {lr}; after each step a pause of "
        f"{pause_ms:g} ms, the last rank's {factor:g}x; {seconds:g} s per run, {repeats} repeat{'s' if repeats != 1 else ''} interleaved"
    )
    runs = bench_straggler(config, progress=_echo)
    rows = summarize(runs)
    _echo(
        f"{'variant':>10} {'time to ' + format(target, '.0%'):>14} {'vs sync':>8} {'final acc':>10} {'fast steps/s':>13}"
    )
    for row in rows:
        reached = "not reached" if row["seconds_to_target"] is None else f"{row['seconds_to_target']:.2f} s"
        ratio = "" if row["vs_sync"] is None else f"{row['vs_sync']:.2f}"
        _echo(
            f"{row['variant']:>10} {reached:>14} {ratio:>8} {100 * row['final_accuracy']:>9.2f}% "
            f"{row['fast_steps_per_s']:>13.1f}"
        )
    if json_path:
        from dataclasses import asdict

        payload = {"benchmark": "straggler", "world_size": hpcddp.size(), "backend": hpcddp.backend()}
        payload |= {"config": asdict(config), "machine": describe_machine(), "summary": rows}
        _write_json(json_path, payload | {"runs": [asdict(r) for r in runs]})
    if plot_path and hpcddp.rank() == 0:
        from ..bench.plot import plot_time_to_accuracy

        title = f"digits, {hpcddp.size()} ranks, last rank {factor:g}x slower"
        plot_time_to_accuracy(runs, plot_path, target, title=title)
        click.echo(f"wrote {plot_path}")
