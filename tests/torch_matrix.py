"""Counts of hpcddp's multi-rank suites under the running torch: what docs/torch_matrix.sh prints per release.

    python -m tests.torch_matrix [-np 2] [--suites mpi mpi_torch torch_suite]

``mpi`` and ``mpi_torch`` run on every rank of one mpirun job (``hpcddp.testing.ranks``
ends the job at the first failure, else the other ranks would wait in their next
collective): a failed or hung test is recorded and the job starts again without it, so
one failure does not hide the tests after it. ``torch_suite`` is torch's own distributed
suite on "mpi" (``tests.torch_suite.driver``, which relaunches past a failure itself).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpcddp.testing import run_mpi

REPO = Path(__file__).resolve().parents[1]
SUITES = ("mpi", "mpi_torch", "torch_suite")
#: seconds one launch of a pytest suite may run (tests/test_multirank.py and test_torch_backend.py allow 600 and 300)
LAUNCH_LIMIT_S = {"mpi": 900, "mpi_torch": 600}


@dataclass(kw_only=True)
class Counts:
    """One suite's outcome under one torch."""

    passed: int = 0
    """tests that passed."""
    failed: int = 0
    """tests that failed, errored, hung or crashed (named in ``broken``)."""
    skipped: int = 0
    """tests skipped (by the suite itself: a feature this build or backend lacks)."""
    broken: dict[str, str] = field(default_factory=dict)
    """test id -> "fail", "error", "hang" or "crash"."""
    seconds: float = 0.0
    """wall-clock time of the whole suite."""

    def line(self) -> str:
        """Return ``N passed, N failed, N skipped`` and the broken tests' ids."""
        text = f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped in {self.seconds:.0f} s"
        if self.broken:
            text += " (" + ", ".join(f"{test}: {outcome}" for test, outcome in self.broken.items()) + ")"
        return text


_SUMMARY = re.compile(r"=+ (.*\d+ (?:passed|skipped|deselected).*) in [\d.]+s")
_FAILED = re.compile(r"\[rank \d+\] FAILED (\S+)")
_COLLECT_ERROR = re.compile(r"\[rank \d+\] ERROR collecting (\S+)")
_STARTED = re.compile(r"^(tests/\S+::\S+)", re.MULTILINE)


def run_pytest_suite(path: str, num_ranks: int, launch_limit: float, max_launches: int = 10) -> Counts:
    """Run pytest on ``path`` at ``num_ranks`` ranks, relaunching past failures; return its counts.

    Args:
        path: a test directory of this repository, e.g. ``tests/mpi_torch``.
        num_ranks: ranks of each mpirun job.
        launch_limit: seconds before a launch is killed (its running test counts as a hang).
        max_launches: launches at most (each failure costs one).
    """
    counts, started, excluded = Counts(), time.monotonic(), []
    for _ in range(max_launches):
        command = [sys.executable, "-m", "pytest", "-v", "--color=no", "-p", "no:cacheprovider"]
        command += ["-p", "hpcddp.testing.ranks", *excluded, path]
        env = {"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1"}
        result = run_mpi(num_ranks, command, timeout=launch_limit, env=env, cwd=str(REPO))
        summaries = _SUMMARY.findall(result.stdout)
        if result.returncode == 0 and summaries:
            numbers = dict((word, int(n)) for n, word in re.findall(r"(\d+) (\w+)", summaries[-1]))
            counts.passed, counts.skipped = numbers.get("passed", 0), numbers.get("skipped", 0)
            break
        broken = _FAILED.search(result.stdout)
        collect = _COLLECT_ERROR.search(result.stdout)
        if broken:
            test, outcome, flag = broken.group(1), "fail", "--deselect"
        elif collect:
            test, outcome, flag = collect.group(1), "error", "--ignore"
        elif result.timed_out and _STARTED.findall(result.stdout):
            test, outcome, flag = _STARTED.findall(result.stdout)[-1], "hang", "--deselect"
        else:
            running = _STARTED.findall(result.stdout)
            test, outcome, flag = (running[-1] if running else path), "crash", "--deselect"
        print(f"{test}: {outcome}\n{result.stdout[-4000:]}", file=sys.stderr)
        progress = test not in counts.broken and test != path
        counts.broken[test] = outcome
        if not progress:
            break  # do not launch the same job again
        excluded += [flag, test]
    counts.failed = len(counts.broken)
    counts.seconds = time.monotonic() - started
    return counts


def run_torch_suite(num_ranks: int, limit: float = 1800.0) -> Counts:
    """Run torch's own distributed suite on "mpi" at ``num_ranks`` ranks; return its counts.

    Args:
        num_ranks: ranks of each mpirun job.
        limit: seconds for the whole suite.
    """
    from tests.torch_suite.driver import SuiteRun, list_tests

    started = time.monotonic()
    suite = SuiteRun("mpi", num_ranks, list_tests("mpi"), test_limit=90, log=lambda line: None)
    suite.run(started + limit)
    broken = {test: outcome for test, outcome in suite.outcomes.items() if outcome not in ("pass", "skip")}
    tally = suite.counts()
    return Counts(
        passed=tally["pass"],
        failed=len(broken),
        skipped=tally["skip"],
        broken=broken,
        seconds=time.monotonic() - started,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2, dest="ranks", help="ranks of every job")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument(
        "--launches", type=int, default=10, help="launches of a pytest suite at most (1: stop at a failure)"
    )
    args = parser.parse_args(argv)
    failed = 0
    for suite in args.suites:
        if suite == "torch_suite":
            counts = run_torch_suite(args.ranks)
        else:
            counts = run_pytest_suite(f"tests/{suite}", args.ranks, LAUNCH_LIMIT_S[suite], args.launches)
        failed += counts.failed
        print(f"torch {torch.__version__} {suite} at {args.ranks} ranks: {counts.line()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
