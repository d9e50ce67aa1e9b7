"""torch's own distributed test suite on hpcddp's "mpi" backend, at 2 and 3 MPI ranks.

The reference is torch's suite itself: its tests compare each collective with values
they compute locally. ``tests.torch_suite.driver`` runs it under mpirun (one job for
all tests, a hung or crashed test relaunched past), with the suite's gates for DDP,
subgroups and gloo-only collectives lifted for "mpi".
"""

from __future__ import annotations

import time

import pytest

from tests.torch_suite.driver import SuiteRun, list_tests

pytestmark = pytest.mark.ranks

#: fewer passes than this means tests stopped running (a gate, an import), not that they got better
LEAST_PASSING = {2: 95, 3: 95}


@pytest.mark.parametrize("ranks", [2, 3])
def test_torch_distributed_suite_passes_on_mpi(ranks):
    tests = list_tests("mpi")
    suite = SuiteRun("mpi", ranks, tests, test_limit=90, log=lambda line: None)
    suite.run(time.monotonic() + 900)
    broken = {test: outcome for test, outcome in suite.outcomes.items() if outcome not in ("pass", "skip")}
    details = "\n\n".join(
        f"{test}: {outcome}\n{suite.details.get(test, '')[-1500:]}" for test, outcome in broken.items()
    )
    assert not broken, details
    assert suite.counts()["pass"] >= LEAST_PASSING[ranks], suite.counts()
