"""Shared fixtures. Multi-rank suites in tests/mpi run only under mpirun (see test_multirank.py)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests/mpi modules assume they run on every rank of an mpirun job; the
# single-process session launches them through test_multirank.py instead.
collect_ignore = [] if os.environ.get("HPCDDP_MPI_TESTS") else ["mpi", "mpi_torch"]


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Variables by which hpcddp would think an MPI launcher, srun or torchrun started this process.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
)


@pytest.fixture
def world_of_one(monkeypatch):
    """hpcddp.init() as a plain process (a world of one), shut down and torch threads restored after."""
    import torch

    import hpcddp

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    hpcddp.init()
    yield
    hpcddp.shutdown()
    torch.set_num_threads(threads)
