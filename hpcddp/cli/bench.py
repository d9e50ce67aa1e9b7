"""`hpcddp bench allreduce|train`: run on every rank (``mpirun -np N hpcddp bench ...``); rank 0 prints. `bench inspector` runs alone."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import click

__all__ = ["bench"]


def _output_path(ctx, param, value):
    """An output file whose folder exists, checked before a run that may take minutes (plots: a known format)."""
    if value is None:
        return value
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"{value!r}: folder {folder} does not exist: create it first", ctx, param)
    if param.name == "plot_path" and os.path.splitext(value)[1].lower() not in (".png", ".pdf", ".svg"):
        raise click.BadParameter(f"{value!r} must end in .png, .pdf or .svg", ctx, param)
    return value


def _finite(ctx, param, value):
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}", ctx, param)
    return value


json_option = click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    callback=_output_path,
    help="Write the results as JSON here (rank 0).",
)


@click.group()
def bench() -> None:
    """Measure allreduce bandwidth and training-step cost against the raw libraries and torch DDP, and the stall inspector at scale."""


def _size(ctx, param, value):
    from ..bench.metrics import parse_size

    try:
        return parse_size(value, f"--{param.name.removesuffix('_size')}")
    except ValueError as err:
        raise click.BadParameter(str(err), ctx=ctx, param=param) from None


def _launcher_rank() -> int:
    """This process's rank as the launcher set it, before hpcddp.init() (0 when alone)."""
    from ..fault.abort import launcher_rank

    return launcher_rank() or 0


def _fail_once(message: str) -> None:
    """Raise a usage error on the launcher's rank 0 only; the other ranks exit quietly with the
    same status, so ``mpirun -np 8`` prints the fix once instead of eight times."""
    if _launcher_rank() == 0:
        raise click.UsageError(message)
    raise SystemExit(2)


PLOT_HINT = "--plot needs matplotlib: pip install 'hpcddp[plot]' (or pip install matplotlib)"


def _echo(line: str = "") -> None:
    import hpcddp

    if hpcddp.rank() == 0:
        click.echo(line)


def _write_json(path: str, payload: dict) -> None:
    import hpcddp

    if hpcddp.rank() == 0:
        with open(path, "w") as out:
            json.dump(payload, out, indent=2)
            out.write("\n")
        click.echo(f"wrote {path}")


@bench.command()
@click.option(
    "--min",
    "min_size",
    default="8",
    show_default=True,
    callback=_size,
    help="Smallest message (bytes; K/M/G suffixes).",
)
@click.option(
    "--max",
    "max_size",
    default="256M",
    show_default=True,
    callback=_size,
    help="Largest message; sizes double from --min.",
)
@click.option(
    "--iters", default=20, show_default=True, type=click.IntRange(min=1), help="Timed iterations per size and path."
)
@click.option(
    "--warmup", default=5, show_default=True, type=click.IntRange(min=0), help="Untimed iterations before them."
)
@click.option(
    "--paths",
    default="hpcddp,mpi4py,torch",
    show_default=True,
    help="Comma-separated: hpcddp (hpcddp.allreduce_), mpi4py (raw Allreduce on numpy), torch (torch.distributed: gloo on CPU, nccl on GPU).",
)
@click.option(
    "--span",
    type=click.Choice(["world", "node", "between-nodes"]),
    default="world",
    show_default=True,
    help="Which ranks reduce together: all; each node's among themselves (shared memory); one per node (the links).",
)
@click.option(
    "--out-of-place",
    is_flag=True,
    help="Reduce into a second buffer: hpcddp.allreduce and MPI's Allreduce(sendbuf, recvbuf) (torch stays in place).",
)
@click.option(
    "--op",
    type=click.Choice(["sum", "average"]),
    default="sum",
    show_default=True,
    help="average: hpcddp's default op; mpi4py and torch then divide the sum themselves (numpy, div_).",
)
@json_option
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Write a PNG of busbw against size here (needs the plot extra: pip install 'hpcddp[plot]').",
)
def allreduce(min_size, max_size, iters, warmup, paths, span, out_of_place, op, json_path, plot_path) -> None:
    """Sweep float32 sum-allreduce over message sizes; print time, algbw and busbw (nccl-tests' definitions)."""
    from ..bench.metrics import size_sweep

    try:
        sizes = size_sweep(min_size, max_size)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    requested = [p.strip() for p in paths.split(",") if p.strip()]
    from ..bench.allreduce import PATHS

    unknown = [p for p in requested if p not in PATHS]
    if unknown or not requested:
        raise click.BadParameter(f"--paths must list names among {', '.join(PATHS)}, got {paths!r}")
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        _fail_once(PLOT_HINT)

    import hpcddp

    from ..bench.allreduce import available_paths, path_label, results_as_dicts, sweep_allreduce
    from ..bench.machine import describe_machine

    hpcddp.init()
    chosen = available_paths(requested)
    if span != "world" and hpcddp.backend() != "mpi" and "hpcddp" in chosen:
        chosen.remove("hpcddp")
        _echo("# hpcddp: sub-groups of ranks need backend mpi, skipped")
    labels = [path_label(p) for p in chosen]
    _echo(
        f"# allreduce float32 {op}{' out of place' if out_of_place else ''}, {hpcddp.size()} ranks on "
        f"{hpcddp.num_nodes()} node(s), span {span}, "
        f"backend {hpcddp.backend()}, {iters} iters after {warmup} warm-up"
    )
    _echo("# time: median over iterations, slowest rank; algbw = size/time; busbw = algbw * 2(n-1)/n (GB/s = 1e9 B/s)")
    header = f"{'size':>10} {'count':>10}" + "".join(
        f" | {label + ' us':>13} {'algbw':>7} {'busbw':>7}" for label in labels
    )
    if "hpcddp" in labels and "mpi4py" in labels:
        _echo("# busbw ratio: hpcddp's bus bandwidth over mpi4py's (above 1: hpcddp moves more bytes per second)")
        header += " | busbw ratio hpcddp/mpi4py"
    _echo(header)
    results = []
    for size in sizes:
        row = sweep_allreduce(
            [size], iters=iters, warmup=warmup, paths=chosen, out_of_place=out_of_place, span=span, op=op
        )
        results += row
        line = f"{size:>10} {size // 4:>10}" + "".join(
            f" | {r.time_us:>13.1f} {r.algbw:>7.3f} {r.busbw:>7.3f}" for r in row
        )
        by_path = {r.path: r for r in row}
        if "hpcddp" in by_path and "mpi4py" in by_path:
            # busbw ratio, as a time ratio: busbw is 0 in a world of one.
            line += f" | {by_path['mpi4py'].time_us / by_path['hpcddp'].time_us:>26.2f}"
        _echo(line)
    if json_path:
        payload = {
            "benchmark": "allreduce",
            "world_size": hpcddp.size(),
            "backend": hpcddp.backend(),
            "iters": iters,
            "warmup": warmup,
            "out_of_place": out_of_place,
            "op": op,
            "span": span,
            "num_nodes": hpcddp.num_nodes(),
            "machine": describe_machine(),
            "results": results_as_dicts(results),
        }
        _write_json(json_path, payload)
    if plot_path and hpcddp.rank() == 0:
        from ..bench.plot import plot_busbw

        plot_busbw(results, plot_path, title=f"allreduce busbw, {hpcddp.size()} ranks")
        click.echo(f"wrote {plot_path}")


@bench.command()
@click.option(
    "--count", default=8, show_default=True, type=click.IntRange(min=1), help="float32 elements per allreduce."
)
@click.option(
    "--iters",
    default=2000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed calls per path, over all rounds.",
)
@click.option(
    "--rounds", default=5, show_default=True, type=click.IntRange(min=1), help="Turns each path takes (interleaved)."
)
@click.option(
    "--paths",
    default="hpcddp,mpi4py,mpi-floor,torch-mpi,gloo",
    show_default=True,
    help="Comma-separated: hpcddp (hpcddp.allreduce_), mpi4py (raw Allreduce), mpi-floor (mpi4py: the agreement's "
    "Iallreduce, then Allreduce: hpcddp's MPI calls), torch-mpi (dist.all_reduce on "
    'hpcddp\'s torch backend, the one named "mpi"), gloo (dist.all_reduce on gloo).',
)
@json_option
def latency(count, iters, rounds, paths, json_path) -> None:
    """Time a small blocking sum-allreduce (median us per call, slowest rank) on each path, beside raw mpi4py."""
    requested = [p.strip() for p in paths.split(",") if p.strip()]
    from ..bench.latency import LATENCY_PATHS

    unknown = [p for p in requested if p not in LATENCY_PATHS]
    if unknown or not requested:
        raise click.BadParameter(f"--paths must list names among {', '.join(LATENCY_PATHS)}, got {paths!r}")
    if iters < rounds:
        raise click.BadParameter(f"--iters must be >= --rounds ({rounds}), got {iters}")

    import hpcddp

    from ..bench.latency import latency_as_dicts, measure_latency
    from ..bench.machine import describe_machine

    hpcddp.init()
    checks = hpcddp.communicator().check_collectives
    _echo(
        f"# blocking allreduce of {count} float32 (sum), {hpcddp.size()} ranks, backend {hpcddp.backend()}, "
        f"checks {'on' if checks else 'off'}, {iters} calls per path in {rounds} interleaved rounds, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    _echo("# time: median us per call, slowest rank; x mpi4py: that time over raw mpi4py's")
    results = measure_latency(count=count, iters=iters, rounds=rounds, paths=requested)
    _echo(f"{'path':>10} {'us':>9} {'x mpi4py':>9}")
    for r in results:
        ratio = "" if r.vs_mpi4py is None else f"{r.vs_mpi4py:.1f}"
        _echo(f"{r.path:>10} {r.time_us:>9.1f} {ratio:>9}")
    if json_path:
        payload = {
            "benchmark": "latency",
            "world_size": hpcddp.size(),
            "backend": hpcddp.backend(),
            "check_collectives": checks,
            "iters": iters,
            "rounds": rounds,
            "machine": describe_machine(),
            "results": latency_as_dicts(results),
        }
        _write_json(json_path, payload)


@bench.command()
@click.option(
    "--model",
    type=click.Choice(["mlp", "conv"]),
    default="mlp",
    show_default=True,
    help="mlp: 8 x Linear(1024,1024)+ReLU (bandwidth-bound); conv: 5 conv blocks on 32x32 (compute-bound).",
)
@click.option(
    "--batch-size", default=32, show_default=True, type=click.IntRange(min=1), help="Samples per rank per step."
)
@click.option(
    "--steps", default=20, show_default=True, type=click.IntRange(min=1), help="Timed steps per round (median taken)."
)
@click.option(
    "--warmup", default=5, show_default=True, type=click.IntRange(min=0), help="Untimed steps before them, every round."
)
@click.option(
    "--repeats",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rounds of all variants; the median round counts.",
)
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1), help="torch threads per rank.")
@click.option(
    "--variants",
    default="local,ddp,ddp-hpcddp,horovod,hpcddp",
    show_default=True,
    help="Comma-separated among local, ddp (torch DDP on gloo/nccl), ddp-hpcddp (torch DDP on the hpcddp "
    "backend), ddp-powersgd (the same with torch's PowerSGD hook, rank 1), horovod (skipped when it does not "
    "import), hpcddp, hpcddp-fp16 (fp16 gradients on the wire), hpcddp-powersgd (rank 1, from the first step), "
    "hpcddp-int8, hpcddp-reproducible (reproducible=True: exact sums, one backward pass a micro-batch), local-sgd (local steps, parameters averaged every 4).",
)
@click.option(
    "--bucket-cap-mb",
    type=click.FloatRange(min=0, min_open=True),
    help="hpcddp's bucket size (MiB); its default when unset.",
)
@click.option(
    "--compression",
    type=click.Choice(["none", "fp16", "bf16"]),
    default="none",
    show_default=True,
    help="hpcddp's wire dtype.",
)
@json_option
def train(model, batch_size, steps, warmup, repeats, threads, variants, bucket_cap_mb, compression, json_path) -> None:
    """Time training steps of a reference model: local compute, torch DDP, Horovod, hpcddp."""
    from ..bench.train import VARIANTS

    requested = [v.strip() for v in variants.split(",") if v.strip()]
    unknown = [v for v in requested if v not in VARIANTS]
    if unknown or not requested:
        raise click.BadParameter(f"--variants must list names among {', '.join(VARIANTS)}, got {variants!r}")

    import torch

    import hpcddp

    from ..bench.machine import describe_machine
    from ..bench.models import build_workload
    from ..bench.train import bench_train, horovod_available

    hpcddp.init(num_threads=threads)
    torch.set_num_threads(threads)
    workload = build_workload(model, batch_size, seed=hpcddp.rank(), device=hpcddp.device())
    options = {"compression": None if compression == "none" else compression}
    if bucket_cap_mb is not None:
        options["bucket_cap_mb"] = bucket_cap_mb
    _echo(
        f"# {model}: {workload.num_parameters:,} parameters, batch {batch_size}/rank, {hpcddp.size()} ranks, "
        f"{threads} thread(s)/rank, backend {hpcddp.backend()}; {repeats} rounds of {warmup} warm-up + {steps} timed steps"
    )
    if "horovod" in requested and not horovod_available():
        _echo("# horovod: not importable, skipped")
    results = bench_train(workload, requested, steps, warmup, repeats, options, progress=_echo)
    _echo(f"{'variant':>11} {'step ms':>9} {'samples/s':>10} {'overhead':>9} {'vs ddp':>7}   runs (ms)")
    for r in results:
        overhead = "" if r.overhead is None else f"{r.overhead * 100:+.1f}%"
        vs_ddp = "" if r.vs_ddp is None else f"{r.vs_ddp:.2f}"
        runs = " ".join(f"{t:.1f}" for t in r.runs_ms)
        _echo(f"{r.variant:>11} {r.step_ms:>9.2f} {r.samples_per_s:>10.1f} {overhead:>9} {vs_ddp:>7}   {runs}")
    timeline = next((r.timeline for r in results if r.timeline), None)
    if timeline:
        spans = ", ".join(
            f"#{i} {mb:.1f}MiB {a:.1f}->{b:.1f}"
            for i, (mb, a, b) in enumerate(
                zip(timeline["bucket_mb"], timeline["bucket_launch_ms"], timeline["bucket_done_ms"])
            )
        )
        _echo(
            f"# hpcddp last step, ms after backward start: backward ends {timeline['backward_end_ms']:.1f}; buckets {spans}"
        )
    if json_path:
        from dataclasses import asdict

        payload = {
            "benchmark": "train",
            "model": model,
            "num_parameters": workload.num_parameters,
            "batch_size": batch_size,
            "world_size": hpcddp.size(),
            "backend": hpcddp.backend(),
            "threads": threads,
            "steps": steps,
            "warmup": warmup,
            "repeats": repeats,
            "hpcddp_options": options,
            "machine": describe_machine(),
            "results": [asdict(r) for r in results],
        }
        _write_json(json_path, payload)


def _rank_counts(ctx, param, value):
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 2 for n in counts):
        raise click.BadParameter(f"must be comma-separated rank counts >= 2, e.g. 512,4096; got {value!r}", ctx, param)
    return counts


@bench.command()
@click.option(
    "--ranks",
    default="512,4096",
    show_default=True,
    callback=_rank_counts,
    help="Comma-separated job sizes to simulate.",
)
@click.option(
    "--group",
    type=click.Choice(["mpi", "torch"]),
    default="mpi",
    show_default=True,
    help="The communicator the ranks wait on: hpcddp's MPI one, or the torch backend's default group.",
)
@json_option
def inspector(ranks, group, json_path) -> None:
    """Simulate the stall inspector's rank 0 for p ranks, one late, in this process (no MPI needed)."""
    from ..bench.inspector import bench_inspector

    click.echo(
        f"{'ranks':>6} {'verdict s':>10} {'reply B/rank':>13} {'rank 0 MiB':>11} {'receive s':>10} "
        f"{'received MiB':>13}  verdict, report lines"
    )
    results = []
    for num_ranks in ranks:
        r = bench_inspector(num_ranks, group)
        results.append(r)
        click.echo(
            f"{r.ranks:>6} {r.verdict_s:>10.3f} {r.reply_bytes:>13} {r.rank0_mib:>11.1f} {r.receive_s:>10.3f} "
            f"{r.received_mib:>13.1f}  {r.verdict}, {r.report_lines}"
        )
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"benchmark": "inspector", "group": group, "results": [r._asdict() for r in results]}, out)
            out.write("\n")
        click.echo(f"wrote {json_path}")
