"""Run the tests/mpi suites on 2 and 4 MPI ranks of this host, each launch with a time limit."""

import sys

import pytest

from hpcddp.testing import assert_pytest_passed, run_mpi, run_pytest_on_ranks

from .conftest import ROOT

pytestmark = pytest.mark.ranks

# Generous for a shared 2-core machine: 4 ranks start torch and run DDP side by side.
TIME_LIMIT_S = 600


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_mpi_suite(num_ranks):
    assert_pytest_passed(run_pytest_on_ranks(num_ranks, ["tests/mpi"], timeout=TIME_LIMIT_S, cwd=ROOT))


# The communicator's and the Horovod API's suites at an odd world size too (uneven splits, rings,
# halves, process sets), in one launch.
THREE_RANK_FILES = [
    "tests/mpi/test_comm_ops.py",
    "tests/mpi/test_horovod.py",
    "tests/mpi/test_horovod_ops.py",
    "tests/mpi/test_horovod_adasum.py",
]


def test_comm_suites_at_three_ranks():
    assert_pytest_passed(run_pytest_on_ranks(3, THREE_RANK_FILES, timeout=TIME_LIMIT_S, cwd=ROOT))


def test_time_limit_kills_a_hung_job(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    result = run_mpi(2, [sys.executable, str(script)], timeout=5, cwd=ROOT)
    assert result.timed_out and result.returncode == 124


def test_a_launcher_that_fails_before_any_rank_starts_is_launched_again(monkeypatch):
    import hpcddp.testing as testing

    outputs = [(1, "The PMIx server's listener thread failed to start. We cannot\ncontinue.\n"), (0, "ran\n")]
    calls = []

    def run_once(command, timeout, full_env, cwd):
        calls.append(timeout)
        code, out = outputs[len(calls) - 1]
        return testing.MPIRunResult(command, code, out, None)

    monkeypatch.setattr(testing, "_run_once", run_once)
    result = run_mpi(2, [sys.executable, "-c", "pass"], timeout=120)
    assert (result.returncode, len(calls)) == (0, 2), result.stdout
    assert "launched again" in result.stdout and result.stdout.endswith("ran\n")


def test_a_job_that_fails_by_itself_is_not_launched_again(monkeypatch):
    import hpcddp.testing as testing

    calls = []

    def run_once(command, timeout, full_env, cwd):
        calls.append(timeout)
        return testing.MPIRunResult(command, 1, "ValueError: boom\n", None)

    monkeypatch.setattr(testing, "_run_once", run_once)
    assert run_mpi(2, [sys.executable, "-c", "pass"], timeout=120).returncode == 1
    assert len(calls) == 1


def test_a_job_ended_by_hpcddp_inside_a_test_shows_why(tmp_path):
    # pytest holds fd 2 while a test runs: without the ranks plugin's abort callback the reason hpcddp
    # writes before MPI_Abort ended with the process, unseen.
    (tmp_path / "test_ends.py").write_text(
        "import hpcddp\n"
        "from hpcddp.fault.abort import abort_job\n\n\n"
        "def test_ends_the_job():\n"
        "    print('printed by the test')\n"
        "    if hpcddp.rank() == 1:\n"
        "        abort_job('[hpcddp rank 1] the reason for the abort', use_mpi=True)\n"
        "    hpcddp.barrier()\n"
    )
    result = run_pytest_on_ranks(2, [str(tmp_path / "test_ends.py")], timeout=120, cwd=str(tmp_path))
    assert result.returncode != 0
    assert "[rank 1] the job ends inside test_ends.py::test_ends_the_job; it printed:" in result.stdout, result.stdout
    assert "printed by the test" in result.stdout and "the reason for the abort" in result.stdout, result.stdout
