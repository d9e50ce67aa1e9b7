"""What the framework jobs share: their data, the backend argument and the file each rank writes.

Every job runs as ``JOB BACKEND OUTDIR``: with ``mpi`` under mpirun on hpcddp's backend,
with ``gloo`` under ``torchrun`` (the reference, which never imports hpcddp).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

NUM_SAMPLES = 64
BATCH_SIZE = 4
NUM_EPOCHS = 2


def parse_arguments() -> tuple[str, str]:
    """Return (backend, output directory) from the command line."""
    backend, outdir = sys.argv[1:3]
    if backend not in ("mpi", "gloo"):
        raise ValueError(f"backend must be 'mpi' or 'gloo', got {backend!r}")
    return backend, outdir


def regression_data(num_samples: int = NUM_SAMPLES, seed: int = 1) -> torch.utils.data.TensorDataset:
    """The same random regression set (8 features, 1 target) on every rank and every run."""
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(num_samples, 8, generator=generator), torch.randn(num_samples, 1, generator=generator)
    )


def small_net() -> torch.nn.Module:
    """An 8-16-1 tanh network."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def save_result(outdir: str, model: torch.nn.Module, **info) -> None:
    """Write this rank's final parameters and what it ran on to OUTDIR/rank<R>.{pt,json}."""
    rank = dist.get_rank()
    info.update(rank=rank, world_size=dist.get_world_size(), backend=dist.get_backend())
    info["group"] = type(dist.group.WORLD).__name__
    if "hpcddp" in sys.modules:
        from hpcddp.comm import oplog

        info["hpcddp_operations"] = sum(oplog.started_counts().values())
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    torch.save(state, os.path.join(outdir, f"rank{rank}.pt"))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as file:
        json.dump(info, file)


def end_process_group() -> None:
    """End the process group, as torch asks of every script before it exits.

    A gloo group still alive at interpreter exit can abort the process ("terminate called
    without an active exception", SIGABRT): the accelerate reference did so once in CI.
    """
    dist.destroy_process_group()
