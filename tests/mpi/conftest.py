"""Run on every rank of an mpirun job: one hpcddp.init() per process; a failure aborts all ranks."""

import os
import sys

import pytest
import torch

import hpcddp


def pytest_configure(config):
    hpcddp.init()
    # Ranks compare numbers with DDP; one thread each keeps runs repeatable and
    # avoids oversubscribing the host's cores.
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("setup", "call", "teardown"):
        # The other ranks would wait forever in their next collective: print this
        # rank's failure and abort the whole job, as `python -m mpi4py` does.
        sys.stderr.write(f"\n[rank {hpcddp.rank()}] FAILED {item.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(autouse=True)
def _keep_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _ranks_in_step():
    yield
    hpcddp.barrier()


def pytest_sessionfinish(session, exitstatus):
    if exitstatus not in (0, 5) and hpcddp.is_initialized():
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(int(exitstatus) or 1)


@pytest.fixture(scope="session")
def gloo():
    """torch.distributed on gloo beside hpcddp's MPI backend, for DDP as the reference."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from hpcddp.bootstrap import launcher_comm
        from hpcddp.comm.rendezvous import join_process_group

        join_process_group("gloo", hpcddp.rank(), hpcddp.size(), mpi_comm=launcher_comm())
    return dist
