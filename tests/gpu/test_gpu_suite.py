"""The GPU suite on one GPU: 2 ranks sharing it over mpi, then nccl at world size 1 (mpirun jobs).

Without CUDA it fails where ``HPCDDP_GPU_SUITE_DEVICE=cuda`` is set (run_gpu_suite.sh's default) and
skips where it is unset (a plain ``pytest``). ``HPCDDP_GPU_SUITE_DEVICE=cpu`` runs the 2-rank job on
the CPU instead, where the tests that need CUDA skip: the rehearsal of the suite's plumbing
(tests/gpu/rehearse.sh). ``HPCDDP_GPU_SKIP_JOBS`` ("mpi", "nccl") skips the jobs whose smoke
launch failed.

Every test of a job runs even when one fails: ``hpcddp.testing.ranks`` ends the whole job at a
rank's first failure (the other ranks would wait in their next collective), so a job that
ended early is launched again without the tests that already ran, until each test has an
outcome or the job's time is spent. The outcomes go to ``$HPCDDP_GPU_SUITE_OUT/ranks.json``
for the summary (tests/gpu/summarize.py), after every launch and when the stage's limit
interrupts one. A job whose last launch did not exit 0 fails, even with every test passed (a
crash at shutdown).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time

import pytest

from hpcddp.testing import run_mpi

from ..conftest import ROOT
from .conftest import BIND, SUITE_DEVICE, UNBOUND_ENV

OUT_DIR = os.environ.get("HPCDDP_GPU_SUITE_OUT")
# Each job's limit, all its launches together; with the smoke stage and the benchmark, inside
# run_gpu_suite.sh's limits on the GPU machine. The rehearsal on a busy CPU machine gives more.
MPI_JOB_LIMIT_S = float(os.environ.get("HPCDDP_GPU_MPI_JOB_S", "300"))
NCCL_JOB_LIMIT_S = float(os.environ.get("HPCDDP_GPU_NCCL_JOB_S", "150"))
# A relaunch needs at least this long to start mpirun, import torch and reach a test.
MIN_LAUNCH_S = 30
# One test's limit on the ranks (pytest-timeout, where installed: the GPU machine has it):
# a test that hangs outside a collective (the stall inspector's 30 s) ends its launch, and
# the next launch runs the tests after it. run_gpu_suite.sh scales it by LIMIT_SCALE.
TEST_LIMIT_S = int(os.environ.get("HPCDDP_GPU_TEST_S", "60"))
HAS_PYTEST_TIMEOUT = importlib.util.find_spec("pytest_timeout") is not None
# A collective that hangs ends its job well inside the job's limit, so the next launch still
# has time for the tests after it (hpcddp's defaults, 60 s and 1800 s, outlast the limits).
HANG_LIMITS = {"HPCDDP_STALL_TIMEOUT": "30", "HPCDDP_STALL_ABORT_AFTER": "60", "HPCDDP_DIST_TIMEOUT": "90"}

#: the jobs run_gpu_suite.sh skips because their smoke launch failed ("mpi", "nccl")
SKIPPED_JOBS = os.environ.get("HPCDDP_GPU_SKIP_JOBS", "").split()

pytestmark = [pytest.mark.system, pytest.mark.gpu, pytest.mark.usefixtures("cuda_where_the_suite_asks_for_it")]


# A test's id as pytest -v prints it; a stall report or a killed launch's command line may name
# one too, followed by punctuation.
_NODEID = r"tests/gpu/ranks/[\w/.-]+\.py::\w+(?:\[[^\]\s]*\])?"
_RESULT = re.compile(rf"({_NODEID}) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b")
_STARTED = re.compile(_NODEID)
_ABORTED = re.compile(rf"\[rank (\d+)\] FAILED ({_NODEID})")
_COLLECTION_ERROR = re.compile(r"\[rank \d+\] ERROR collecting")
# tests/gpu/ranks/conftest.py prints each launch's collected tests on one line (rank 0).
_COLLECTED = re.compile(r"^\[gpu-suite\] collected:(.*)$", re.MULTILINE)


def run_job_to_the_end(
    num_ranks: int, path: str, env: dict[str, str], limit_s: float, on_launch=lambda outcome: None
) -> dict:
    """Run ``path``'s tests on ``num_ranks`` ranks, relaunching after a failure until each test has an outcome.

    Returns ``{"tests": {nodeid: outcome}, "launches": [how each ended], "seconds": s, "tails": [the
    end of each failed launch's output]}``; an outcome is passed, failed, skipped, xfailed, xpassed,
    error, "did not finish" (the launch ended inside it: a hang, a crash, the time limit) or "not
    run" (collected, but no launch reached it).

    Args:
        num_ranks: ranks per launch.
        path: the test file, relative to the repository root.
        env: more environment variables for the ranks.
        limit_s: seconds for all launches together.
        on_launch: called with the outcome so far after each launch, and before a
            KeyboardInterrupt (the stage's SIGTERM) is raised on.
    """
    started_at = time.monotonic()
    deadline = started_at + limit_s
    outcomes: dict[str, str] = {}
    collected: list[str] = []
    launches: list[str] = []
    tails: list[str] = []

    def so_far() -> dict:
        return {
            "tests": {**outcomes, **{nodeid: "not run" for nodeid in collected if nodeid not in outcomes}},
            "launches": launches,
            "seconds": round(time.monotonic() - started_at),
            "tails": tails,
        }

    while deadline - time.monotonic() >= MIN_LAUNCH_S:
        launched = time.monotonic()
        command = [sys.executable, "-m", "pytest", "-v", "-rs", "--color=no", "-p", "no:cacheprovider"]
        command += ["-p", "hpcddp.testing.ranks", path]
        if HAS_PYTEST_TIMEOUT:
            command.append(f"--timeout={TEST_LIMIT_S}")
        command += [arg for nodeid in outcomes for arg in ("--deselect", nodeid)]
        job_env = {"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1", **HANG_LIMITS, **UNBOUND_ENV, **env}
        try:
            result = run_mpi(
                num_ranks, command, timeout=deadline - time.monotonic(), env=job_env, cwd=ROOT, bind=BIND
            )  # fmt: skip
        except KeyboardInterrupt:
            # run_mpi ended the job (its output goes with it): keep what the launches before it found.
            launches.append(f"interrupted by the stage's limit after {time.monotonic() - launched:.0f} s")
            tails.append(f"[interrupted] the launch had run {time.monotonic() - launched:.0f} s: {' '.join(command)}")
            on_launch(so_far())
            raise
        out = result.stdout
        for line in _COLLECTED.findall(out):
            collected.extend(nodeid for nodeid in line.split() if nodeid not in collected)
        # The collected list names every test: only the lines after it say what ran.
        out = _COLLECTED.sub("", out)
        ended = "killed at the job's limit" if result.timed_out else f"exit {result.returncode}"
        launches.append(f"{ended} after {time.monotonic() - launched:.0f} s")
        if result.returncode != 0:
            tails.append(out[-4000:])
        before = len(outcomes)
        for nodeid, outcome in _RESULT.findall(out):
            if outcomes.get(nodeid) != "failed":  # a failure on any rank is the test's outcome
                outcomes[nodeid] = outcome.lower().replace("xfail", "xfailed").replace("xpass", "xpassed")
        for _rank, nodeid in _ABORTED.findall(out):
            outcomes[nodeid] = "failed"
        for nodeid in _STARTED.findall(out):
            outcomes.setdefault(nodeid, "did not finish")
        on_launch(so_far())
        if result.returncode == 0 or _COLLECTION_ERROR.search(out) or len(outcomes) == before:
            break  # done, or nothing would run differently in another launch
    return so_far()


def _record(job: str, outcome: dict) -> None:
    """Add ``job``'s outcome to ranks.json under ``$HPCDDP_GPU_SUITE_OUT`` (when set), for the summary."""
    if not OUT_DIR:
        return
    path = os.path.join(OUT_DIR, "ranks.json")
    jobs = {}
    if os.path.exists(path):
        with open(path) as file:
            jobs = json.load(file)
    jobs[job] = {key: value for key, value in outcome.items() if key != "tails"}
    if outcome["tails"]:  # the end of the last failed launch's output, for a job interrupted or crashed
        jobs[job]["last_failed_tail"] = outcome["tails"][-1][-2000:]
    with open(path, "w") as file:
        json.dump(jobs, file, indent=1)


def _assert_all_passed(job: str, outcome: dict) -> None:
    tests = outcome["tests"]
    bad = {nodeid: result for nodeid, result in tests.items() if result not in ("passed", "skipped", "xfailed")}
    lines = [f"{result:>14}  {nodeid}" for nodeid, result in tests.items()]
    print(f"{job}: {len(tests)} tests, {outcome['seconds']} s, launches: {'; '.join(outcome['launches'])}")
    print("\n".join(lines))
    failed_launches = "".join(f"\n--- a failed launch's last lines ---\n{tail}" for tail in outcome["tails"])
    assert tests, f"{job}: no test reported a result{failed_launches}"
    assert not bad, f"{job}: {len(bad)} of {len(tests)} did not pass: {bad}{failed_launches}"
    last = outcome["launches"][-1]
    assert last.startswith("exit 0"), f"{job}: every test passed but its last launch ended '{last}'{failed_launches}"


def _run_and_record(job: str, num_ranks: int, path: str, env: dict[str, str], limit_s: float) -> None:
    if limit_s < MIN_LAUNCH_S:
        # run_gpu_suite.sh cut the stage to the time left: no launch could reach a test.
        pytest.skip(f"{job}: no time: the job's limit {limit_s:.0f} s is under the {MIN_LAUNCH_S} s a launch needs")
    outcome = run_job_to_the_end(num_ranks, path, env, limit_s, on_launch=lambda so_far: _record(job, so_far))
    _assert_all_passed(job, outcome)


def test_two_ranks_sharing_the_gpu_over_mpi():
    if "mpi" in SKIPPED_JOBS:
        pytest.skip("the smoke test's mpi launch failed (HPCDDP_GPU_SKIP_JOBS)")
    env = {"HPCDDP_BACKEND": "mpi", "HPCDDP_GPU_SUITE_DEVICE": SUITE_DEVICE}
    if SUITE_DEVICE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    _run_and_record("mpi, 2 ranks", 2, "tests/gpu/ranks/test_mpi_ranks.py", env, MPI_JOB_LIMIT_S)


def test_nccl_at_world_size_one():
    if SUITE_DEVICE != "cuda":
        pytest.skip("nccl needs CUDA")
    if "nccl" in SKIPPED_JOBS:
        pytest.skip("the smoke test's nccl launch failed (HPCDDP_GPU_SKIP_JOBS)")
    env = {"HPCDDP_BACKEND": "nccl", "HPCDDP_GPU_SUITE_DEVICE": "cuda"}
    _run_and_record("nccl, 1 rank", 1, "tests/gpu/ranks/test_nccl_rank.py", env, NCCL_JOB_LIMIT_S)
