"""torch.distributed on the hpcddp backend: the tests/mpi_torch suite under mpirun at 2 and 3 ranks.

One launch per world size runs every collective, DDP, FSDP2, DistributedSampler and
distributed checkpoints against gloo in the same processes (see tests/mpi_torch).
"""

import sys

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT

TIME_LIMIT_S = 300


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_torch_backend_suite(num_ranks):
    result = run_mpi(
        num_ranks,
        [sys.executable, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider", "tests/mpi_torch"],
        timeout=TIME_LIMIT_S,
        env={"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert result.returncode == 0, (
        f"mpirun -np {num_ranks} failed (exit {result.returncode}):\n{result.stdout[-20000:]}"
    )
    assert "passed" in result.stdout, result.stdout[-5000:]
