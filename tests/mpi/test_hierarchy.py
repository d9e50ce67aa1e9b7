"""The two-level allreduce against numpy's sum of every rank's data, on node layouts
made up over this host's ranks (even, uneven, interleaved nodes)."""

import numpy as np
import pytest
import torch

import hpcddp
from hpcddp.comm.base import ReduceOp
from hpcddp.comm.mpi import MPICommunicator
from hpcddp.comm.mpi.hierarchy import NodeHierarchy
from hpcddp.env.mpi_import import import_mpi


def layouts(size):
    even = [f"node{r // 2}" for r in range(size)]
    interleaved = [f"node{r % 2}" for r in range(size)]
    uneven = ["node0"] * (size - 1) + ["node1"]
    one_per_node = [f"node{r}" for r in range(size)]
    return {"even": even, "interleaved": interleaved, "uneven": uneven, "one per node": one_per_node}


def rank_data(rank, count, dtype):
    rng = np.random.default_rng(1000 + rank)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


@pytest.mark.parametrize("layout", ["even", "interleaved", "uneven", "one per node"])
def test_two_level_allreduce_matches_numpy(layout):
    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    hierarchy = NodeHierarchy(comm, MPI, hosts=layouts(size)[layout])
    try:
        # Counts below, at and above the ranks per node; not multiples of it.
        for count in (1, 3, 1001, 65537):
            for dtype in (np.float32, np.float64, np.int32, np.int64):
                for op, reduce in ((MPI.SUM, np.sum), (MPI.MIN, np.min), (MPI.MAX, np.max)):
                    data = rank_data(rank, count, dtype)
                    expected = reduce(np.stack([rank_data(r, count, dtype) for r in range(size)]), axis=0)
                    hierarchy.allreduce(data, op)
                    if np.issubdtype(dtype, np.integer) or op is not MPI.SUM:
                        np.testing.assert_array_equal(data, expected)
                    else:
                        np.testing.assert_allclose(
                            data, expected, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5
                        )
                    # Every rank holds the same bits, not only close values.
                    assert all(np.array_equal(data, other) for other in comm.allgather(data))
    finally:
        hierarchy.free()


def test_communicator_forced_hierarchical_reduces_every_dtype_and_op():
    comm = MPICommunicator(hierarchical=True)
    size = hpcddp.size()
    try:
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
            for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX):
                if op is ReduceOp.AVERAGE and not dtype.is_floating_point:
                    continue
                # 40000 elements: above the size from which the two levels are used.
                base = [torch.arange(40000, dtype=torch.float64) % 97 + r for r in range(size)]
                mine = base[hpcddp.rank()].to(dtype, copy=True)
                stacked = torch.stack(base)
                expected = {
                    ReduceOp.SUM: stacked.sum(0),
                    ReduceOp.AVERAGE: stacked.mean(0),
                    ReduceOp.MIN: stacked.min(0).values,
                    ReduceOp.MAX: stacked.max(0).values,
                }[op].to(dtype)
                comm.allreduce_async_(mine, op).wait()
                torch.testing.assert_close(mine, expected, msg=f"{dtype} {op}")
                blocking = base[hpcddp.rank()].to(dtype, copy=True)
                comm.allreduce_(blocking, op)
                torch.testing.assert_close(blocking, expected, msg=f"{dtype} {op} (blocking)")
    finally:
        comm.close()


@pytest.mark.parametrize("shape", [(200, 97), (7, 3001), (3, 5, 4099)])
def test_forced_hierarchical_allreduce_of_any_shape_matches_the_sum(shape):
    # Issue 18: a 2-D tensor of 64 KiB and more failed with "mismatch in send count" (shards cut along dim 0).
    comm = MPICommunicator(hierarchical=True)
    size = hpcddp.size()
    try:
        base = [torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 89 + r for r in range(size)]
        expected = torch.stack(base).sum(0)
        mine = base[hpcddp.rank()].clone()
        comm.allreduce_(mine, ReduceOp.SUM)
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
        transposed = base[hpcddp.rank()].transpose(0, -1).clone().transpose(0, -1)  # non-contiguous, same values
        comm.allreduce_async_(transposed, ReduceOp.SUM).wait()
        torch.testing.assert_close(transposed, expected, rtol=0, atol=0)
    finally:
        comm.close()
