"""Shared fixtures. Multi-rank suites in tests/mpi run only under mpirun (see test_multirank.py)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests/mpi modules assume they run on every rank of an mpirun job; the
# single-process session launches them through test_multirank.py instead.
collect_ignore = [] if os.environ.get("HPCDDP_MPI_TESTS") else ["mpi"]


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
