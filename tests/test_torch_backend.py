"""torch.distributed on the hpcddp backend: the tests/mpi_torch suite under mpirun at 2 and 3 ranks.

One launch per world size runs every collective, DDP, FSDP2, DistributedSampler and
distributed checkpoints against gloo in the same processes (see tests/mpi_torch).
"""

import sys

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT

TIME_LIMIT_S = 300


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_torch_backend_suite(num_ranks):
    result = run_mpi(
        num_ranks,
        [sys.executable, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider", "tests/mpi_torch"],
        timeout=TIME_LIMIT_S,
        env={"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert result.returncode == 0, (
        f"mpirun -np {num_ranks} failed (exit {result.returncode}):\n{result.stdout[-20000:]}"
    )
    assert "passed" in result.stdout, result.stdout[-5000:]


def test_init_process_group_hpcddp_in_a_world_of_one(world_of_one):
    import torch
    import torch.distributed as dist

    dist.init_process_group("hpcddp")
    try:
        assert (dist.get_backend(), dist.get_rank(), dist.get_world_size()) == ("hpcddp", 0, 1)
        tensor = torch.arange(4.0)
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(tensor, torch.arange(4.0), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("dtype", "op", "error", "message"),
    [
        ("float32", "PREMUL_SUM", ValueError, "PREMUL_SUM is NCCL-only"),
        ("int64", "AVG", TypeError, "AVG needs a floating-point tensor, got torch.int64"),
        ("float32", "BAND", TypeError, "BAND needs an integer tensor"),
        ("bool", "SUM", TypeError, "cannot reduce tensors of dtype torch.bool"),
    ],
)
def test_reductions_mpi_cannot_do_are_refused(dtype, op, error, message):
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcddp.torch_backend._buffers import reduce_spec

    with pytest.raises(error, match=message):
        reduce_spec(MPI, getattr(torch, dtype), getattr(dist.ReduceOp, op))
