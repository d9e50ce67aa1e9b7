"""Run torch's distributed suite on N MPI ranks; a test that hangs or crashes costs only itself.

    python -m tests.torch_suite.driver --backend mpi -np 2 [--only PATTERN] [--json FILE]

The driver starts ``rank_main`` under mpirun with the tests still to run, reads each
rank's outcome lines as they are written, and when a test runs past its limit (or the
job ends in the middle of one) kills the job, records that test as ``hang``/``crash``,
and starts the job again from the next test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcddp.cli.launch import mpirun_command

REPO = Path(__file__).resolve().parents[2]
OUTCOMES = ("pass", "fail", "error", "hang", "crash", "skip")


def list_tests(backend: str) -> list[str]:
    """The suite's test names for ``backend`` (imported in a child: the gates are set at import)."""
    code = "from tests.torch_suite.rank_main import test_names; print('\\n'.join(test_names()))"
    env = {**os.environ, "BACKEND": backend, "WORLD_SIZE": "2", "TEMP_DIR": tempfile.gettempdir()}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _read_events(out_dir: Path, ranks: int) -> dict[int, list[dict]]:
    events = {}
    for rank in range(ranks):
        path = out_dir / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        events[rank] = [json.loads(line) for line in lines if line.endswith("}")]
    return events


def _dump_stacks(out_dir: Path, ranks: int) -> None:
    """Ask every rank of a stuck job for its threads' stacks (they land in mpirun.log)."""
    for rank_events in _read_events(out_dir, ranks).values():
        for event in rank_events:
            if event["event"] == "pid":
                try:
                    os.kill(event["pid"], signal.SIGUSR1)
                except ProcessLookupError:
                    pass
    time.sleep(2)


class SuiteRun:
    """One backend at one world size: the outcome of every test, worst rank first."""

    def __init__(self, backend: str, ranks: int, tests: list[str], test_limit: float, log=print):
        self.backend, self.ranks, self.tests = backend, ranks, tests
        self.test_limit = test_limit
        self.log = log
        self.outcomes: dict[str, str] = {}
        self.details: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def run(self, deadline: float) -> dict[str, str]:
        work = Path(tempfile.mkdtemp(prefix=f"torch-suite-{self.backend}{self.ranks}-"))
        launches = 0
        while len(self.outcomes) < len(self.tests) and time.monotonic() < deadline:
            remaining = [t for t in self.tests if t not in self.outcomes]
            launches += 1
            self._launch(remaining, work / f"launch{launches}", deadline)
            if remaining[0] not in self.outcomes and len(self.tests) - len(remaining) == len(self.outcomes):
                self.outcomes[remaining[0]] = "crash"  # no progress at all: never launch the same list twice
        for test in self.tests:
            self.outcomes.setdefault(test, "hang")  # the overall limit passed before it ran
        shutil.rmtree(work, ignore_errors=True)
        return self.outcomes

    def _launch(self, tests: list[str], out_dir: Path, deadline: float) -> None:
        (out_dir / "barrier").mkdir(parents=True)
        (out_dir / "test_dir").mkdir()
        listing = out_dir / "tests.txt"
        listing.write_text("\n".join(tests) + "\n")
        env = {
            "BACKEND": self.backend,
            "TEMP_DIR": str(out_dir),
            "SUITE_OUT": str(out_dir),
            "SUITE_TESTS": str(listing),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        command = mpirun_command(self.ranks, [sys.executable, "-m", "tests.torch_suite.rank_main"], env=env)
        with open(out_dir / "mpirun.log", "w") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=REPO,
                start_new_session=True,
            )
            stuck = self._watch(proc, out_dir, deadline)
        events = _read_events(out_dir, self.ranks)
        if stuck is not None:  # the test some rank had not finished, else rank 0's last
            stuck = self._unfinished(events) or stuck.removesuffix(":done")
        if not any(events.values()):
            log_tail = (out_dir / "mpirun.log").read_text()[-3000:]
            raise RuntimeError(f"the suite's job ended before its first test:\n{log_tail}")
        self._record(events)
        running = stuck or self._unfinished(events)
        if running and running not in self.outcomes:
            self.outcomes[running] = "hang" if stuck else "crash"
            self.details[running] = (out_dir / "mpirun.log").read_text()[-20000:]
            self.log(f"  {running}: {self.outcomes[running]}")

    def _watch(self, proc, out_dir: Path, deadline: float) -> str | None:
        """Wait for the job; return the test it was stuck in when killed, else None."""
        current, since = None, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            started = self._started(out_dir)
            if started != current:
                current, since = started, time.monotonic()
            if time.monotonic() - since > self.test_limit or time.monotonic() > deadline:
                _dump_stacks(out_dir, self.ranks)
                # SIGTERM first: mpirun then ends its ranks, which run in process groups of their own.
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return current
        return None

    def _started(self, out_dir: Path) -> str | None:
        path = out_dir / "rank0.jsonl"
        if not path.exists():
            return None
        for line in reversed(path.read_text().splitlines()):
            if line.endswith("}"):
                event = json.loads(line)
                if "test" not in event:
                    return None
                return event["test"] + ("" if event["event"] == "start" else ":done")
        return None

    def _unfinished(self, events) -> str | None:
        for rank_events in events.values():
            if rank_events and rank_events[-1]["event"] == "start":
                return rank_events[-1]["test"]
        return None

    def _record(self, events) -> None:
        by_test = collections.defaultdict(list)
        for rank_events in events.values():
            for event in rank_events:
                if event["event"] == "end":
                    by_test[event["test"]].append(event)
        for test, ends in by_test.items():
            if len(ends) < self.ranks or test in self.outcomes:
                continue
            worst = max(ends, key=lambda e: ("skip", "pass", "fail", "error").index(e["outcome"]))
            self.outcomes[test] = worst["outcome"]
            self.details[test] = worst["detail"]
            self.seconds[test] = max(e["seconds"] for e in ends)
            if worst["outcome"] in ("fail", "error"):
                self.log(f"  {test}: {worst['outcome']}")

    def counts(self) -> dict[str, int]:
        counter = collections.Counter(self.outcomes.values())
        return {outcome: counter.get(outcome, 0) for outcome in OUTCOMES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpi", choices=("mpi", "gloo"))
    parser.add_argument("-np", type=int, default=2, dest="ranks")
    parser.add_argument("--only", default="", help="run only the tests whose name contains this text")
    parser.add_argument("--test-limit", type=float, default=90.0, help="seconds one test may run")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds for the whole suite")
    parser.add_argument("--json", help="write every test's outcome and detail here")
    args = parser.parse_args(argv)
    tests = [t for t in list_tests(args.backend) if args.only in t]
    started = time.monotonic()
    suite = SuiteRun(args.backend, args.ranks, tests, args.test_limit)
    suite.run(started + args.limit)
    counts = suite.counts()
    print(
        f"{args.backend} at {args.ranks} ranks, {len(tests)} tests in {time.monotonic() - started:.0f} s: "
        + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES)
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"outcomes": suite.outcomes, "details": suite.details, "seconds": suite.seconds, "counts": counts},
                indent=1,
            )
        )
    return 0 if counts["fail"] + counts["error"] + counts["hang"] + counts["crash"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
