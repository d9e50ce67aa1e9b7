"""Run the tests/mpi suites on 2 and 4 MPI ranks of this host, each launch with a time limit."""

import sys

import pytest

from hpcddp.testing import assert_pytest_passed, run_mpi, run_pytest_on_ranks

from .conftest import ROOT

# Generous for a shared 2-core machine: 4 ranks start torch and run DDP side by side.
TIME_LIMIT_S = 600


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_mpi_suite(num_ranks):
    assert_pytest_passed(run_pytest_on_ranks(num_ranks, ["tests/mpi"], timeout=TIME_LIMIT_S, cwd=ROOT))


# The communicator's and the Horovod API's suites at an odd world size too (uneven splits, rings,
# halves, process sets), in one launch.
THREE_RANK_FILES = ["tests/mpi/test_comm_ops.py", "tests/mpi/test_horovod.py", "tests/mpi/test_horovod_ops.py"]


def test_comm_suites_at_three_ranks():
    assert_pytest_passed(run_pytest_on_ranks(3, THREE_RANK_FILES, timeout=TIME_LIMIT_S, cwd=ROOT))


def test_time_limit_kills_a_hung_job(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    result = run_mpi(2, [sys.executable, str(script)], timeout=5, cwd=ROOT)
    assert result.timed_out and result.returncode == 124
