"""Run Horovod's own ``test/parallel/test_torch.py`` against hpcddp.horovod and count the outcomes.

    python tests/compat/run_horovod_suite.py --horovod-src /path/to/horovod [--np 2] [--chunk 8]

``import horovod.torch as hvd`` is made to resolve to hpcddp.horovod by a directory of
stand-in modules put first on PYTHONPATH (``horovod``, ``horovod.torch``, and the one
``horovod.runner`` helper Horovod's ``test/utils/common.py`` imports). The tests run under
mpirun in chunks, each chunk its own launch with a time limit; every rank writes its own
JUnit report, and a test counts as passed only when it passed on every rank. Tests of a
chunk that crashed or ran out of time without a report count as failed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET
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


def _rank_reports(directory: Path) -> dict[str, set[str]]:
    """Return {outcome: test names} merged over every rank's JUnit report."""
    outcomes: dict[str, dict[str, str]] = {}
    for report in sorted(directory.glob("rank*.xml")):
        try:
            tree = ET.parse(report)
        except ET.ParseError:
            continue
        for case in tree.iter("testcase"):
            name = case.get("name", "")
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            previous = outcomes.setdefault(name, {}).get("outcome")
            # failed beats passed beats skipped, over ranks
            order = {"failed": 2, "passed": 1, "skipped": 0}
            if previous is None or order[outcome] > order[previous]:
                outcomes[name]["outcome"] = outcome
    merged: dict[str, set[str]] = {"passed": set(), "failed": set(), "skipped": set()}
    for name, entry in outcomes.items():
        merged[entry["outcome"]].add(name)
    return merged


def run_suite(source: Path, num_ranks: int = 2, chunk: int = 8, timeout: float = 300, verbose: bool = True) -> dict:
    """Run Horovod's torch suite against hpcddp.horovod; return counts and the failed tests.

    Args:
        source: a Horovod checkout (the directory holding ``test/parallel``).
        num_ranks: ranks per launch.
        chunk: tests per launch.
        timeout: seconds each launch may run.
        verbose: print each chunk's outcome.
    """
    sys.path.insert(0, str(ROOT))
    from hpcddp.testing import run_mpi

    tests = list_tests(source)
    results: dict[str, set[str]] = {"passed": set(), "failed": set(), "skipped": set()}
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hpcddp-hvd-") as scratch:
        shim = write_shim(Path(scratch) / "shim")
        env = {
            "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }
        for start in range(0, len(tests), chunk):
            names = tests[start : start + chunk]
            reports = Path(scratch) / f"chunk{start}"
            reports.mkdir()
            ids = [f"{SUITE}::TorchTests::{name}" for name in names]
            command = [sys.executable, str(Path(__file__).resolve()), "--rank-pytest", str(reports), *ids]
            result = run_mpi(num_ranks, command, timeout=timeout, env=env, cwd=str(source))
            merged = _rank_reports(reports)
            for outcome, found in merged.items():
                results[outcome] |= found
            missing = [n for n in names if not any(n in found for found in merged.values())]
            results["failed"] |= set(missing)
            for name in missing:
                logs[name] = "no report (the launch crashed or timed out)"
            if verbose:
                status = "timed out" if result.timed_out else f"exit {result.returncode}"
                print(
                    f"[{start // chunk + 1}] {status}: "
                    + ", ".join(f"{len(merged[k] & set(names))} {k}" for k in ("passed", "failed", "skipped"))
                    + (f", {len(missing)} without report" if missing else ""),
                    flush=True,
                )
                for name in sorted((merged["failed"] & set(names)) | set(missing)):
                    print(f"    FAILED {name}", flush=True)
            if missing or merged["failed"] & set(names):
                logs[f"chunk{start}"] = result.stdout[-4000:]
    counts = {k: len(v - (results["failed"] if k != "failed" else set())) for k, v in results.items()}
    return {"counts": counts, "failed": sorted(results["failed"]), "logs": logs}


def _rank_pytest(reports: str, ids: list[str]) -> int:
    import pytest

    rank = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK") if v in os.environ), "0")
    args = ["-q", "-p", "no:cacheprovider", "--color=no", f"--junitxml={reports}/rank{rank}.xml", *ids]
    return pytest.main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-pytest"]:
        return _rank_pytest(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"), help="Horovod checkout (HOROVOD_SRC)")
    parser.add_argument("--np", type=int, default=2, help="ranks per launch")
    parser.add_argument("--chunk", type=int, default=8, help="tests per launch")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch")
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
