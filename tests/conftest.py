"""Shared fixtures. Multi-rank suites in tests/mpi run only under mpirun (see test_multirank.py)."""

import glob
import os
import shutil
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests/mpi modules assume they run on every rank of an mpirun job; the
# single-process session launches them through test_multirank.py instead.
collect_ignore = [] if os.environ.get("HPCDDP_MPI_TESTS") else ["mpi", "mpi_torch"]


def pytest_configure(config):
    """Give the session's launchers a TMPDIR of their own (the ranks of tests/mpi inherit it).

    mpirun keeps its session directory at $TMPDIR/ompi.<pid>; one left on this machine by a
    killed mpirun makes a later mpirun with the same pid fail at start-up (see
    hpcddp.fault.launcher_process), so what others left must not decide a test.
    """
    if os.environ.get("HPCDDP_MPI_TESTS") or hasattr(config, "workerinput"):
        return
    config._hpcddp_tmpdir = tempfile.mkdtemp(prefix="hpcddp-tests-")
    os.environ["TMPDIR"] = config._hpcddp_tmpdir


#: Every test carries one of these (setup.cfg describes them): ``python -m pytest -m unit`` is the fast tier.
TIERS = ("unit", "ranks", "system")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Refuse a test with no tier marker or with several, before ``-m`` deselects any."""
    if os.environ.get("HPCDDP_MPI_TESTS"):
        return  # the suites that run on every rank take the tier of the test that launches them
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) == 1:
            continue
        found = f"has tiers {', '.join(tiers)}" if tiers else "has no tier"
        raise pytest.UsageError(
            f"{item.nodeid} {found}: give it exactly one of pytest.mark.unit, ranks or system "
            "(pytestmark = pytest.mark.<tier> for its module, or a mark per test where the module mixes tiers)"
        )


def pytest_terminal_summary(terminalreporter, config):
    directory = getattr(config, "_hpcddp_tmpdir", None)
    left = glob.glob(os.path.join(directory, "ompi.[0-9]*")) if directory else []
    if left:
        terminalreporter.write_line(f"{len(left)} mpirun session directories left by killed launchers: {left}")


def pytest_unconfigure(config):
    directory = getattr(config, "_hpcddp_tmpdir", None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Variables by which hpcddp would think an MPI launcher, srun or torchrun started this process.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
)


@pytest.fixture
def world_of_one(monkeypatch):
    """hpcddp.init() as a plain process (a world of one), shut down and torch threads restored after."""
    import torch

    import hpcddp

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    hpcddp.init()
    yield
    hpcddp.shutdown()
    torch.set_num_threads(threads)
