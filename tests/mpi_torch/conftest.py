"""Run on every rank of an mpirun job (see tests/test_torch_backend.py): hpcddp.init(), then torch.distributed.

The default group is ``init_process_group("hpcddp", init_method="env://")``; the reference
is a gloo group over the same ranks, made with ``new_group(backend="gloo")``. Plumbing
(init, failures, environment) in hpcddp.testing.ranks.
"""

import pytest


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
