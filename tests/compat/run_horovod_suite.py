"""Run Horovod's own ``test/parallel/test_torch.py`` against hpcddp.horovod and count the outcomes.

    python tests/compat/run_horovod_suite.py --horovod-src /path/to/horovod [--np 2] [--chunk 8]

``import horovod.torch as hvd`` is made to resolve to hpcddp.horovod by a directory of
stand-in modules put first on PYTHONPATH (``horovod``, ``horovod.torch``, and the one
``horovod.runner`` helper Horovod's ``test/utils/common.py`` imports). The tests run under
mpirun in chunks, each chunk its own launch with a time limit; every rank writes its own
record of outcomes, and a test counts as passed only when it passed on every rank. A test
in which a launch crashed or ran out of time counts as failed, and the rest of its chunk
runs again in a new launch.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = "test/parallel/test_torch.py"

_SHIM = {
    "horovod/__init__.py": '"""Stand-in for Horovod: the modules its torch tests import, served by hpcddp."""\n',
    "horovod/torch/__init__.py": (
        "from hpcddp.horovod import *  # noqa: F403\nfrom hpcddp.horovod import __all__  # noqa: F401\n"
    ),
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": (
        "import threading\n\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        '    """Start ``target(*args)`` in a thread and return the thread (Horovod\'s helper)."""\n'
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n"
        "    return thread\n"
    ),
}
# Horovod's test utilities import the ``mock`` backport; the standard library's serves.
_MOCK = "from unittest.mock import *  # noqa: F403\n"


def write_shim(directory: Path) -> Path:
    """Write the stand-in ``horovod`` package into ``directory`` and return it."""
    for relative, text in _SHIM.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (directory / "mock.py").write_text(_MOCK)
    return directory


def list_tests(source: Path) -> list[str]:
    """Return the test method names of Horovod's torch suite, in file order."""
    text = (source / SUITE).read_text()
    return re.findall(r"^    def (test_\w+)\(self", text, flags=re.M)


def _outcomes(directory: Path) -> dict[str, str]:
    """Return {test name: outcome} merged over every rank's record; a failure on any rank wins."""
    order = {"failed": 2, "passed": 1, "skipped": 0}
    merged: dict[str, str] = {}
    for record in sorted(directory.glob("rank*.txt")):
        for line in record.read_text().splitlines():
            name, _, outcome = line.partition(" ")
            if outcome in order and order[outcome] >= order.get(merged.get(name, "skipped"), 0):
                merged[name] = outcome
    return merged


def run_suite(source: Path, num_ranks: int = 2, chunk: int = 6, timeout: float = 240, verbose: bool = True) -> dict:
    """Run Horovod's torch suite against hpcddp.horovod; return counts, the failed tests and launch logs.

    Each rank records every test's outcome as soon as it is known, so a launch that
    hangs or crashes still reports the tests before it; the test it stopped in counts
    as failed and the rest of its chunk runs in a new launch.

    Args:
        source: a Horovod checkout (the directory holding ``test/parallel``).
        num_ranks: ranks per launch.
        chunk: tests per launch.
        timeout: seconds each launch may run.
        verbose: print each launch's outcome.
    """
    sys.path.insert(0, str(ROOT))
    from hpcddp.testing import run_mpi

    tests = list_tests(source)
    outcomes: dict[str, str] = {}
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hpcddp-hvd-") as scratch:
        shim = write_shim(Path(scratch) / "shim")
        env = {
            "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }
        pending = list(tests)
        launch = 0
        while pending:
            names, pending = pending[:chunk], pending[chunk:]
            launch += 1
            records = Path(scratch) / f"launch{launch}"
            records.mkdir()
            ids = [f"{SUITE}::TorchTests::{name}" for name in names]
            command = [sys.executable, str(Path(__file__).resolve()), "--rank-pytest", str(records), *ids]
            result = run_mpi(num_ranks, command, timeout=timeout, env=env, cwd=str(source))
            found = _outcomes(records)
            stuck = next((n for n in names if n not in found), None)
            for name in names:
                outcomes[name] = found.get(name, "failed" if name == stuck else outcomes.get(name, ""))
            if stuck is not None:
                # The launch ended inside ``stuck``: run what came after it again.
                pending = [n for n in names[names.index(stuck) + 1 :] if n not in found] + pending
                logs[stuck] = "timed out" if result.timed_out else f"launch ended (exit {result.returncode})"
            failed = [n for n in names if outcomes.get(n) == "failed"]
            if failed:
                logs[f"launch {launch}: {', '.join(failed)}"] = result.stdout[-6000:]
            if verbose:
                status = "timed out" if result.timed_out else f"exit {result.returncode}"
                counts = ", ".join(
                    f"{sum(found.get(n) == k for n in names)} {k}" for k in ("passed", "failed", "skipped")
                )
                print(f"[{launch}] {status}: {counts}" + (f"; stopped in {stuck}" if stuck else ""), flush=True)
                for name in failed:
                    print(f"    FAILED {name}", flush=True)
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    return {"counts": counts, "failed": sorted(n for n, v in outcomes.items() if v == "failed"), "logs": logs}


class _Recorder:
    """pytest plugin: append each test's outcome to a file as soon as it is known."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a")  # noqa: SIM115 - open for the whole session
        self._failed: set[str] = set()

    def pytest_runtest_logreport(self, report) -> None:
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.failed:
            self._failed.add(name)
            self._write(name, "failed")
        elif report.skipped and report.when in ("setup", "call"):
            self._failed.add(name)  # reported already
            self._write(name, "skipped")
        elif report.when == "teardown" and name not in self._failed:
            self._write(name, "passed")

    def _write(self, name: str, outcome: str) -> None:
        self._file.write(f"{name} {outcome}\n")
        self._file.flush()


def _rank_pytest(records: str, ids: list[str]) -> int:
    import pytest

    rank = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK") if v in os.environ), "0")
    return pytest.main(
        ["-q", "-p", "no:cacheprovider", "--color=no", *ids], plugins=[_Recorder(f"{records}/rank{rank}.txt")]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-pytest"]:
        return _rank_pytest(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"), help="Horovod checkout (HOROVOD_SRC)")
    parser.add_argument("--np", type=int, default=2, help="ranks per launch")
    parser.add_argument("--chunk", type=int, default=6, help="tests per launch")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    parser.add_argument("--show-logs", action="store_true", help="print the output of launches with failures")
    args = parser.parse_args(argv)
    if not args.horovod_src or not (Path(args.horovod_src) / SUITE).is_file():
        parser.error(f"--horovod-src must be a Horovod checkout holding {SUITE}, got {args.horovod_src!r}")
    outcome = run_suite(Path(args.horovod_src), args.np, args.chunk, args.timeout)
    if args.show_logs:
        for key, text in outcome["logs"].items():
            print(f"===== {key}\n{text}")
    counts = outcome["counts"]
    print(f"hpcddp.horovod on Horovod's {SUITE}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped")  # fmt: skip
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
