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
    global _config
    _config = config
    hpcddp.init()
    # Ranks compare numbers with references; one thread each keeps runs repeatable and
    # avoids oversubscribing the host's cores.
    torch.set_num_threads(1)


def _report_and_abort(config, what: str, longrepr: str) -> None:
    text = f"\n[rank {hpcddp.rank()}] {what}\n{longrepr}\n"
    # pytest captures fd 2 while the test runs: write past it, or the abort below loses the report.
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        sys.stderr.write(text)
        sys.stderr.flush()
    abort_all_ranks(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("setup", "call", "teardown"):
        _report_and_abort(item.config, f"FAILED {item.nodeid}", report.longreprtext)


def pytest_collectreport(report):
    if report.failed:  # a module that does not import on this rank: the others would wait for its tests
        _report_and_abort(_config, f"ERROR collecting {report.nodeid}", report.longreprtext)


_config = None
_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config):
    # After pytest's summary (printed at the end of sessionfinish), so that the reason shows.
    if _exit_status not in (0, 5) and hpcddp.is_initialized():
        sys.stderr.write(f"\n[rank {hpcddp.rank()}] pytest ended with exit status {_exit_status}: ending every rank\n")
        sys.stderr.flush()
        abort_all_ranks(_exit_status)


def _show_what_the_test_printed() -> None:
    """At an abort from inside a test (hpcddp ending the job), show what pytest had captured.

    pytest holds fd 2 in a file while a test runs, so the reason ``abort_job`` writes
    there would end with the process, unseen.
    """
    capture = _config.pluginmanager.getplugin("capturemanager") if _config is not None else None
    if capture is None:
        return
    out, err = capture.read_global_capture()
    with capture.global_and_fixture_disabled():
        sys.stderr.write(f"\n[rank {hpcddp.rank()}] the job ends inside {_current_test}; it printed:\n{out}{err}\n")
        sys.stderr.flush()


_current_test = "a test"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _current_test
    _current_test = item.nodeid
    # Again before each test: a test of the abort path may have run the callbacks already.
    from hpcddp.runtime.state import at_abort

    at_abort(_show_what_the_test_printed)


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
