"""`hpcddp info`: versions, MPI/GPU facts, which backends work, and under a launcher the rank map."""

from __future__ import annotations

import json
import time

import click

__all__ = ["info"]


def _mark(ok: bool) -> str:
    return "[X]" if ok else "[ ]"


def _test_active_backend() -> dict:
    """Allreduce ones across the job; return what came back and how long it took."""
    import torch

    import hpcddp

    ones = torch.ones(4, device=hpcddp.device())
    start = time.perf_counter()
    total = hpcddp.allreduce(ones, op="sum")
    elapsed = time.perf_counter() - start
    ok = bool((total == hpcddp.size()).all())
    return {"backend": hpcddp.backend(), "ok": ok, "value": total[0].item(), "microseconds": elapsed * 1e6}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def info(as_json: bool) -> None:
    """Show versions, MPI and GPU facts and which backends work here.

    Under a launcher (mpirun -np 4 hpcddp info, hpcddp run -np 4 hpcddp info, srun)
    it also allreduces across the job and prints every rank's host, local rank,
    device, torch threads and CPUs.
    """
    import hpcddp

    from ..diagnostics import check_backends, describe_rank, gpu_facts, mpi_facts, software_versions

    hpcddp.init()
    report = {
        "versions": software_versions(),
        "mpi": mpi_facts(),
        "gpu": gpu_facts(),
        "backends": [check.as_dict() for check in check_backends()],
        "job": {"size": hpcddp.size(), "backend": hpcddp.backend(), "test": _test_active_backend()},
        "ranks": hpcddp.allgather_object(describe_rank()),
    }
    own_rank = hpcddp.rank()
    hpcddp.shutdown()
    if own_rank != 0:
        return
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    _print_report(report)


def _print_report(report: dict) -> None:
    versions, mpi, gpu = report["versions"], report["mpi"], report["gpu"]
    click.echo(
        f"hpcddp {versions['hpcddp']}  (python {versions['python']}, torch {versions['torch']}, "
        f"mpi4py {versions['mpi4py']}, numpy {versions['numpy']})"
    )
    click.echo("")
    click.echo("MPI:")
    for key in ("library", "standard", "thread_level", "cuda_aware"):
        if key in mpi:
            click.echo(f"    {key.replace('_', ' '):<13} {mpi[key]}")
    click.echo("GPUs:")
    if gpu["gpus"]:
        click.echo(f"    CUDA {gpu['cuda']}, NCCL {gpu.get('nccl', '-')}")
        for index, name in enumerate(gpu["gpus"]):
            click.echo(f"    cuda:{index}  {name}")
    else:
        click.echo("    none (torch sees no CUDA device)")
    click.echo("")
    click.echo("Backends:")
    for check in report["backends"]:
        click.echo(f"    {_mark(check['available'])} {check['name']:<5} {check['detail']}")
    job = report["job"]
    test = job["test"]
    verdict = "ok" if test["ok"] else f"WRONG (got {test['value']:g}, expected {job['size']})"
    click.echo("")
    click.echo(
        f"Job: {job['size']} rank(s), backend {job['backend']}; allreduce across the job: {verdict} "
        f"({test['microseconds']:.0f} us)"
    )
    click.echo(f"    {'rank':>4}  {'host':<20} {'node':>4} {'local':>5}  {'device':<8} {'threads':>7}  cpus")
    for r in report["ranks"]:
        click.echo(
            f"    {r['rank']:>4}  {r['host']:<20} {r['node_rank']:>4} {r['local_rank']:>5}  "
            f"{r['device']:<8} {r['threads']:>7}  {r['cpus']}"
        )
