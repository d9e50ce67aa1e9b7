"""The communicator's newer collectives against numpy arithmetic over every rank's input,
on hpcddp's mpi backend and on torch.distributed's gloo; mismatches raise on every rank."""

import gc
import time
import weakref

import numpy as np
import pytest
import torch

import hpcddp
from hpcddp import CollectiveMismatchError
from hpcddp.comm.base import ReduceOp
from hpcddp.comm.torchdist import TorchDistCommunicator

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


@pytest.fixture(params=["mpi", "gloo"], autouse=True, scope="module")
def comm(request, gloo):
    """Every test runs on hpcddp's mpi backend and on gloo; ``hpcddp.*`` uses the same one."""
    runtime = hpcddp.runtime.state._runtime
    saved = runtime.comm
    if request.param == "gloo":
        runtime.comm = TorchDistCommunicator("gloo", torch.device("cpu"))
    yield runtime.comm
    runtime.comm = saved


def rank_input(rank, shape, dtype):
    """Small values, different per rank, exact in every dtype (also their products of up to 4 ranks)."""
    values = (np.arange(int(np.prod(shape))) % 3 + 1 + (rank % 2)).reshape(shape)
    return torch.tensor(values, dtype=dtype)


def every_input(shape, dtype):
    return np.stack([rank_input(r, shape, torch.float64).numpy() for r in range(hpcddp.size())])


NUMPY_REDUCE = {
    "sum": lambda a: a.sum(0),
    "average": lambda a: a.mean(0),
    "min": lambda a: a.min(0),
    "max": lambda a: a.max(0),
    "product": lambda a: a.prod(0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "product", "min", "max", "average"])
def test_allreduce_every_op_and_dtype(op, dtype):
    if op == "average" and not dtype.is_floating_point:
        pytest.skip("average of integers is refused (tested in test_collectives)")
    out = hpcddp.allreduce(rank_input(hpcddp.rank(), (3, 5), dtype), op=op)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.double().numpy(), NUMPY_REDUCE[op](every_input((3, 5), dtype)), rtol=1e-2)


def test_a_finished_collective_keeps_nothing_alive(comm):
    # gloo kept its last 1,024 Works, and each its tensors: the 300 tensors below stayed alive
    # (on nccl the same, in GPU memory).
    alive = []
    for _ in range(300):
        out = comm.allreduce_async_(torch.ones(64), ReduceOp.SUM).wait()
        assert out[0].item() == hpcddp.size()
        alive.append(weakref.ref(out))
        del out
    gc.collect()
    assert sum(ref() is not None for ref in alive) <= 64


def test_a_wait_with_a_time_limit_returns_on_time_while_a_rank_is_late(comm):
    # On MPI the waiting thread ran the allreduce itself and waited in it for the late rank,
    # 2 s past its 0.3 s limit; the collective itself goes on, and a later wait returns its sum.
    n, me = hpcddp.size(), hpcddp.rank()
    if n == 1:
        pytest.skip("needs two ranks")
    if me == n - 1:
        time.sleep(2.0)
    handle = comm.allreduce_async_(torch.full((4,), float(me + 1)), ReduceOp.SUM)
    if me == 0:
        begun = time.monotonic()
        with pytest.raises(TimeoutError):
            handle.wait(timeout=0.3)
        assert time.monotonic() - begun < 1.5
    assert handle.wait().tolist() == [float(n * (n + 1) // 2)] * 4
    hpcddp.barrier()


def test_allreduce_product_matches_mpi4py():
    from mpi4py import MPI

    mine = np.linspace(0.5, 1.5, 7) + hpcddp.rank()
    expected = MPI.COMM_WORLD.allreduce(mine, op=MPI.PROD)
    np.testing.assert_allclose(hpcddp.allreduce(torch.from_numpy(mine), op="product").numpy(), expected, rtol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "average", "product", "max"])
def test_reducescatter_uneven_rows(op, dtype):
    if op == "average" and not dtype.is_floating_point:
        pytest.skip("average of integers is refused")
    n = hpcddp.size()
    rows = 2 * n + 1  # uneven: the first rank gets one more row
    full = NUMPY_REDUCE[op](every_input((rows, 2), dtype))
    mine = hpcddp.reducescatter(rank_input(hpcddp.rank(), (rows, 2), dtype), op=op)
    counts = [rows // n + (r < rows % n) for r in range(n)]
    start = sum(counts[: hpcddp.rank()])
    assert mine.dtype == dtype and mine.shape == (counts[hpcddp.rank()], 2)
    np.testing.assert_allclose(mine.double().numpy(), full[start : start + counts[hpcddp.rank()]], rtol=1e-2)


def test_reducescatter_explicit_splits_including_empty():
    n = hpcddp.size()
    splits = [0] + [2] * (n - 1) if n > 1 else [3]
    rows = sum(splits)
    full = every_input((rows, 3), torch.float64).sum(0)
    mine = hpcddp.reducescatter(rank_input(hpcddp.rank(), (rows, 3), torch.float64), op="sum", splits=splits)
    start = sum(splits[: hpcddp.rank()])
    np.testing.assert_array_equal(mine.numpy(), full[start : start + splits[hpcddp.rank()]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_alltoall_uneven_splits(dtype):
    n, me = hpcddp.size(), hpcddp.rank()

    def splits_of(r):
        return [(r + d) % 3 for d in range(n)]  # rank r sends (r + d) % 3 rows to rank d

    def rows_of(r):
        return torch.arange(sum(splits_of(r)) * 2, dtype=dtype).reshape(-1, 2) + 100 * r

    out, received = hpcddp.alltoall(rows_of(me), splits=splits_of(me))
    expected = []
    for r in range(n):
        offset = sum(splits_of(r)[:me])
        expected.append(rows_of(r)[offset : offset + splits_of(r)[me]])
    torch.testing.assert_close(out, torch.cat(expected))
    assert received.tolist() == [splits_of(r)[me] for r in range(n)]


def test_alltoall_even_without_splits_takes_a_splits_tensor():
    n, me = hpcddp.size(), hpcddp.rank()
    out, received = hpcddp.alltoall(torch.arange(2 * n) + 10 * me)
    assert out.tolist() == [10 * r + 2 * me + k for r in range(n) for k in range(2)]
    assert received.tolist() == [2] * n
    out, _ = hpcddp.alltoall(torch.arange(n) + 10 * me, splits=torch.ones(n, dtype=torch.int32))
    assert out.tolist() == [10 * r + me for r in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_reduce_onto_every_root(comm, dtype):
    for root in range(comm.size):
        mine = rank_input(comm.rank, (4,), dtype)
        out = comm.reduce_async_(mine, ReduceOp.SUM, root, check="").wait()
        expected = every_input((4,), dtype).sum(0) if comm.rank == root else rank_input(comm.rank, (4,), dtype)
        np.testing.assert_array_equal(out.double().numpy(), expected)
        assert out is mine


def test_gather_rows_that_differ_onto_every_root(comm):
    for root in range(comm.size):
        mine = torch.full((comm.rank + 1, 2), float(comm.rank))
        out = comm.gather_async(mine, root, check="").wait()
        if comm.rank != root:
            assert out is None
            continue
        np.testing.assert_array_equal(out.numpy(), np.concatenate([np.full((r + 1, 2), r) for r in range(comm.size)]))


def test_scatter_chunks_of_different_sizes(comm):
    for root in range(comm.size):
        chunks = [torch.arange(r + 1, dtype=torch.float64) + 10 * root for r in range(comm.size)]
        out = torch.empty(comm.rank + 1, dtype=torch.float64)
        result = comm.scatter_async_(out, chunks if comm.rank == root else None, root, check="").wait()
        assert result is out
        np.testing.assert_array_equal(out.numpy(), np.arange(comm.rank + 1) + 10 * root)


def test_scatter_into_a_wrong_sized_out_raises_everywhere(comm):
    chunks = [torch.ones(2) for _ in range(comm.size)]
    out = torch.empty(3 if comm.rank == comm.size - 1 else 2)
    with pytest.raises(CollectiveMismatchError, match="out holds"):
        comm.scatter_async_(out, chunks if comm.rank == 0 else None, 0, check="").wait()


def test_point_to_point_ring_does_not_hold_up_collectives(comm):
    n, me = comm.size, comm.rank
    if n == 1:
        pytest.skip("a ring needs two ranks")
    got = torch.empty(3)
    receive = comm.recv_async_(got, (me - 1) % n, tag=7)
    # A receive waiting for its message must not stop the collectives behind it.
    assert hpcddp.allreduce(torch.ones(1), op="sum").item() == n
    send = comm.send_async(torch.full((3,), float(me)), (me + 1) % n, tag=7)
    assert receive.wait(timeout=60) is got
    send.wait(timeout=60)
    assert got.tolist() == [float((me - 1) % n)] * 3


def test_split_into_halves_and_singletons(comm):
    n, me = comm.size, comm.rank
    evens = list(range(0, n, 2))
    odds = list(range(1, n, 2))
    for members in (evens, odds):
        sub = comm.split(members) if members else None
        if me not in members:
            assert sub is None
            continue
        assert (sub.rank, sub.size) == (members.index(me), len(members))
        out = sub.allreduce_(torch.tensor([float(me)]), ReduceOp.SUM)
        assert out.item() == sum(members)
        gathered = sub.allgather_async(torch.tensor([me]), check="").wait()
        assert gathered.tolist() == members
        sub.close()


def test_split_renumbers_in_list_order_on_mpi(comm):
    if comm.name != "mpi":
        pytest.skip("gloo groups keep ascending order (tested below)")
    members = list(reversed(range(comm.size)))
    sub = comm.split(members)
    assert sub.rank == members.index(comm.rank)
    assert sub.broadcast_async_(torch.tensor([comm.rank]), 0).wait().item() == members[0]
    sub.close()


def test_split_refuses_bad_ranks_everywhere(comm):
    with pytest.raises((ValueError, CollectiveMismatchError), match="ranks must"):
        comm.split([0, 0])
    mine = [0] if comm.rank == 0 else [comm.size - 1]
    if comm.size > 1:
        with pytest.raises(CollectiveMismatchError, match="splits differs"):
            comm.split(mine)


def test_mismatches_raise_on_every_rank_and_the_communicator_goes_on(comm):
    me, n = comm.rank, comm.size
    last = me == n - 1
    cases = [
        ("shape differs", lambda: hpcddp.allreduce(torch.ones(3 if last else 2))),
        ("dtype differs", lambda: hpcddp.allreduce(torch.ones(2, dtype=torch.int32 if last else torch.float32), "sum")),
        ("reduce op differs", lambda: hpcddp.allreduce(torch.ones(2), op="max" if last else "sum")),
        ("root differs", lambda: hpcddp.broadcast(torch.ones(2), root_rank=1 if last else 0)),
        ("shape after the first dimension differs", lambda: hpcddp.allgather(torch.ones(1, 3 if last else 2))),
        ("splits differs", lambda: hpcddp.reducescatter(torch.ones(n + 1), splits=[1] * (n - 1) + [2] if last else [2] + [1] * (n - 1))),
        ("splits must add up", lambda: hpcddp.alltoall(torch.ones(n), splits=[2] * n if last else [1] * n)),
        ("root differs", lambda: comm.reduce_async_(torch.ones(2), ReduceOp.SUM, 1 if last else 0, check="t").wait()),
        ("dtype differs", lambda: hpcddp.allreduce_async_(torch.ones(2, dtype=torch.float16 if last else torch.bfloat16)).wait()),
    ]  # fmt: skip
    for expected, call in cases:
        with pytest.raises(CollectiveMismatchError, match=expected) as caught:
            call()
        assert f"rank {n - 1}" in str(caught.value) or "ranks" in str(caught.value)
        assert hpcddp.allreduce(torch.full((2,), float(me)), op="sum").tolist() == [n * (n - 1) / 2] * 2


def test_the_check_can_be_turned_off(comm):
    saved = comm.check_collectives
    comm.check_collectives = False
    try:
        # Without the check a local error stays local: the bad rank alone raises, at once.
        if comm.rank == 0:
            with pytest.raises(ValueError, match="splits must"):
                hpcddp.alltoall(torch.ones(comm.size), splits=[5] * comm.size)
        assert hpcddp.allreduce(torch.ones(4), op="sum").tolist() == [comm.size] * 4
    finally:
        comm.check_collectives = saved
