"""torch.distributed on the hpcddp backend: the tests/mpi_torch suite under mpirun at 2 and 3 ranks.

One launch per world size runs every collective, DDP, FSDP2, DistributedSampler and
distributed checkpoints against gloo in the same processes (see tests/mpi_torch).
"""

import pytest

from hpcddp.testing import assert_pytest_passed, run_pytest_on_ranks

from .conftest import ROOT

TIME_LIMIT_S = 300


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_torch_backend_suite(num_ranks):
    result = run_pytest_on_ranks(num_ranks, ["tests/mpi_torch"], timeout=TIME_LIMIT_S, cwd=ROOT)
    assert_pytest_passed(result)


@pytest.mark.ranks
def test_engine_rules_at_four_ranks():
    """Two APIs on one communicator, torch's comm hooks, messages and groups, at four ranks too."""
    result = run_pytest_on_ranks(4, ["tests/mpi_torch/test_engine_rules.py"], timeout=TIME_LIMIT_S, cwd=ROOT)
    assert_pytest_passed(result)


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize(
    ("dtype", "op", "error", "message"),
    [
        ("float32", "PREMUL_SUM", ValueError, "PREMUL_SUM is NCCL-only"),
        ("float32", "BAND", TypeError, "op='band' needs an integer tensor"),
        ("bool", "AVG", TypeError, r"op=AVG cannot reduce bool tensors \(gloo refuses them too\): use ReduceOp.SUM"),
        ("complex64", "SUM", TypeError, "does not support tensors of dtype torch.complex64"),
    ],
)
def test_reductions_mpi_cannot_do_are_refused(dtype, op, error, message):
    import torch
    import torch.distributed as dist

    from hpcddp.comm.reduction import check_reducible, from_torch

    with pytest.raises(error, match=message):
        check_reducible(getattr(torch, dtype), from_torch(getattr(dist.ReduceOp, op)))


@pytest.mark.unit
def test_integer_averages_divide_toward_zero_where_hpcddps_api_refuses_them():
    import torch

    from hpcddp.comm.reduction import ReduceOp, check_average, check_reducible, divide_average_

    # torch's ReduceOp.AVG of integers (PyTorch Lightning sends one) gets NCCL's answer: sum, then toward zero.
    check_reducible(torch.int64, ReduceOp.AVERAGE)
    summed = torch.tensor([-3, 3, 4, -4, 0], dtype=torch.int64)
    assert divide_average_(summed, ReduceOp.AVERAGE, 2).tolist() == [-1, 1, 2, -2, 0]
    assert divide_average_(torch.tensor([-3.0, 3.0]), ReduceOp.AVERAGE, 2).tolist() == [-1.5, 1.5]
    assert divide_average_(torch.tensor([-3, 3]), ReduceOp.SUM, 2).tolist() == [-3, 3]
    with pytest.raises(TypeError, match="op='average' needs a floating-point tensor, got torch.int64: use op='sum'"):
        check_average(torch.int64, ReduceOp.AVERAGE)


@pytest.mark.unit
def test_16_bit_float_reductions_are_made_once_per_process():
    import torch
    from mpi4py import MPI

    from hpcddp.comm.reduction import ReduceOp, mpi_op

    made = mpi_op(MPI, torch.bfloat16, ReduceOp.SUM)
    assert mpi_op(MPI, torch.bfloat16, ReduceOp.AVERAGE) is made  # an average travels as the sum
    assert mpi_op(MPI, torch.float16, ReduceOp.SUM) is not made
    assert mpi_op(MPI, torch.float32, ReduceOp.MAX) is MPI.MAX
