"""A pytest plugin for suites that run on every rank of an mpirun job.

Load it from a conftest (``pytest_plugins = ["hpcddp.testing.ranks"]``) in a test
directory that is launched as ``mpirun -np N python -m pytest DIR`` (see
``hpcddp.testing.run_mpi``). It calls ``hpcddp.init()`` once per process, restores
``os.environ`` after each test, keeps the ranks in step between tests, and turns a
failure on any rank into the end of the whole job, with that rank's report printed:
the other ranks would otherwise wait forever in their next collective.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import hpcddp

__all__ = ["abort_all_ranks"]


def abort_all_ranks(code: int = 1) -> None:
    """End every rank of the job now (``MPI_Abort``), as ``python -m mpi4py`` does after a failure."""
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def pytest_configure(config):
    hpcddp.init()
    # Ranks compare numbers with references; one thread each keeps runs repeatable and
    # avoids oversubscribing the host's cores.
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("setup", "call", "teardown"):
        text = f"\n[rank {hpcddp.rank()}] FAILED {item.nodeid}\n{report.longreprtext}\n"
        # pytest captures fd 2 while the test runs: write past it, or the abort below loses the report.
        capture = item.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            sys.stderr.write(text)
            sys.stderr.flush()
        abort_all_ranks(1)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus not in (0, 5) and hpcddp.is_initialized():
        abort_all_ranks(int(exitstatus) or 1)


@pytest.fixture(autouse=True)
def _keep_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _ranks_in_step():
    yield
    if hpcddp.is_initialized():
        hpcddp.barrier()


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A directory every rank sees (rank 0's temporary directory; one host, or a shared filesystem)."""
    return hpcddp.broadcast_object(str(tmp_path_factory.mktemp("shared")) if hpcddp.rank() == 0 else None, 0)
