"""Run the tests/mpi suites on 2 and 4 MPI ranks of this host, each launch with a time limit."""

import sys

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT

# Generous for a shared 2-core machine: 4 ranks start torch and run DDP side by side.
TIME_LIMIT_S = 600


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_mpi_suite(num_ranks):
    result = run_mpi(
        num_ranks,
        [sys.executable, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider", "tests/mpi"],
        timeout=TIME_LIMIT_S,
        env={"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert result.returncode == 0, (
        f"mpirun -np {num_ranks} failed (exit {result.returncode}):\n{result.stdout[-20000:]}"
    )
    assert "passed" in result.stdout, result.stdout[-5000:]


# The communicator's own suites at an odd world size too (uneven splits, rings, halves), in one launch.
THREE_RANK_FILES = ["tests/mpi/test_comm_ops.py"]


def test_comm_suites_at_three_ranks():
    result = run_mpi(
        3,
        [sys.executable, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider", *THREE_RANK_FILES],
        timeout=TIME_LIMIT_S,
        env={"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert result.returncode == 0, f"mpirun -np 3 failed (exit {result.returncode}):\n{result.stdout[-20000:]}"
    assert "passed" in result.stdout, result.stdout[-5000:]


def test_time_limit_kills_a_hung_job(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    result = run_mpi(2, [sys.executable, str(script)], timeout=5, cwd=ROOT)
    assert result.timed_out and result.returncode == 124
