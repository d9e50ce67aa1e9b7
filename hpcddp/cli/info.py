"""`hpcddp info`: versions, MPI/GPU facts, which backends work, and under a launcher the rank map."""

from __future__ import annotations

import json

import click

__all__ = ["info"]


def _mark(check: dict) -> str:
    if check["works"] is not None:
        return "[X]" if check["works"] else "[!]"
    return "[X]" if check["available"] else "[ ]"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def info(as_json: bool) -> None:
    """Show versions, MPI and GPU facts and which backends work here.

    Under a launcher (mpirun -np 4 hpcddp info, hpcddp run -np 4 hpcddp info, srun)
    it also allreduces across the job and prints every rank's host, local rank,
    device, torch threads and CPUs.
    """
    import hpcddp

    from .diagnostics import (
        check_backends,
        describe_rank,
        gpu_facts,
        mpi_facts,
        software_versions,
        torch_backend_facts,
        try_backends,
    )

    hpcddp.init()
    try:
        mpi = mpi_facts()
        checks = check_backends(mpi)
        try_backends(checks)
        report = {
            "versions": software_versions(),
            "mpi": mpi,
            "gpu": gpu_facts(),
            "torch_distributed": torch_backend_facts(mpi),
            "backends": [check.as_dict() for check in checks],
            "job": {"size": hpcddp.size(), "backend": hpcddp.backend()},
            "ranks": hpcddp.allgather_object(describe_rank()),
        }
        own_rank = hpcddp.rank()
    finally:
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
    click.echo("torch.distributed backend:")
    for key, value in report["torch_distributed"].items():
        click.echo(f"    {key.replace('_', ' '):<13} {value}")
    click.echo("")
    click.echo("Backends ([X] works here, [ ] not available, [!] available but failed):")
    for check in report["backends"]:
        tested = f"; {check['test']}" if check["test"] else ""
        click.echo(f"    {_mark(check)} {check['name']:<5} {check['detail']}{tested}")
    job = report["job"]
    click.echo("")
    click.echo(f"Job: {job['size']} rank(s), backend {job['backend']}")
    click.echo(f"    {'rank':>4}  {'host':<20} {'node':>4} {'local':>5}  {'device':<8} {'threads':>7}  cpus")
    for r in report["ranks"]:
        click.echo(
            f"    {r['rank']:>4}  {r['host']:<20} {r['node_rank']:>4} {r['local_rank']:>5}  "
            f"{r['device']:<8} {r['threads']:>7}  {r['cpus']}"
        )
