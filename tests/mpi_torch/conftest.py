"""Run on every rank of an mpirun job (see tests/test_torch_backend.py): hpcddp.init(), then torch.distributed.

The default group is ``init_process_group("hpcddp", init_method="env://")``; the reference
is a gloo group over the same ranks, made with ``new_group(backend="gloo")``.
A failure on any rank aborts the job.
"""

import os
import sys

import pytest
import torch

import hpcddp


def pytest_configure(config):
    hpcddp.init()
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("setup", "call", "teardown"):
        sys.stderr.write(f"\n[rank {hpcddp.rank()}] FAILED {item.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus not in (0, 5) and hpcddp.is_initialized():
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(int(exitstatus) or 1)


@pytest.fixture(autouse=True)
def _keep_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    hpcddp.barrier()


@pytest.fixture(scope="session")
def gloo():
    """A gloo group over every rank beside the default ``hpcddp`` group (the reference)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # env://: the TCP store at the MASTER_ADDR/PORT hpcddp.init() exported, which the
        # gloo group needs (test_a_mpi_name covers the call with no argument).
        dist.init_process_group("hpcddp", init_method="env://")
    assert dist.get_backend() == "hpcddp"
    return dist.new_group(backend="gloo")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A directory every rank sees (rank 0's temporary directory)."""
    return hpcddp.broadcast_object(str(tmp_path_factory.mktemp("shared")) if hpcddp.rank() == 0 else None, 0)
