"""gloo's outcomes in torch's distributed suite, run the way torch runs it (a spawn per test).

    python -m tests.torch_suite.gloo_reference -np 2 [--only TEXT]

The reference beside ``driver`` (which runs the suite on MPI ranks, one job for all
tests): torch's ``TestDistBackend`` starts ``WORLD_SIZE`` fresh processes for each test
and reads their exit codes, so a test that breaks its group breaks only itself.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
import unittest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2, dest="ranks")
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    temp = tempfile.mkdtemp(prefix="torch-suite-gloo-")
    os.makedirs(os.path.join(temp, "barrier"))
    os.makedirs(os.path.join(temp, "test_dir"))
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(args.ranks), TEMP_DIR=temp, INIT_METHOD="env://")
    from .gloo_spawn_case import GlooWithSpawn as suite_class

    names = [n for n in unittest.TestLoader().getTestCaseNames(suite_class) if args.only in n]
    result = unittest.TestResult()
    started = time.monotonic()
    try:
        unittest.TestSuite([suite_class(n) for n in names]).run(result)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    counts = collections.Counter(
        fail=len(result.failures) + len(result.unexpectedSuccesses),
        error=len(result.errors),
        skip=len(result.skipped),
    )
    counts["pass"] = result.testsRun - sum(counts.values())
    for test, detail in result.failures + result.errors:
        print(f"  {test.id().rsplit('.', 1)[-1]}: {detail.strip().splitlines()[-1][:200]}")
    print(
        f"gloo (spawn) at {args.ranks} ranks, {result.testsRun} tests in {time.monotonic() - started:.0f} s: "
        + ", ".join(f"{counts[o]} {o}" for o in ("pass", "fail", "error", "skip"))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
