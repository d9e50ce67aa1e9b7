"""Run on every rank of an mpirun job (see tests/test_multirank.py); plumbing in hpcddp.testing.ranks."""

import pytest

import hpcddp


@pytest.fixture(scope="session")
def gloo():
    """torch.distributed on gloo beside hpcddp's MPI backend, for DDP as the reference."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from hpcddp.comm.rendezvous import join_process_group
        from hpcddp.runtime.state import launcher_comm

        join_process_group("gloo", hpcddp.rank(), hpcddp.size(), mpi_comm=launcher_comm())
    return dist
