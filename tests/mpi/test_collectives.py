"""Collectives give the same answer as computing it by hand from every rank's input."""

import pytest
import torch

import hpcddp
from hpcddp.comm.torchdist import TorchDistCommunicator


@pytest.fixture(params=["mpi", "gloo"], autouse=True, scope="module")
def backend(request, gloo):
    """Run every test here on hpcddp's mpi backend and on torch.distributed's gloo."""
    runtime = hpcddp.runtime.state._runtime
    saved = runtime.comm
    if request.param == "gloo":
        runtime.comm = TorchDistCommunicator("gloo", torch.device("cpu"))
    yield request.param
    runtime.comm = saved


def rank_tensor(dtype=torch.float32):
    return torch.arange(6, dtype=dtype).reshape(2, 3) + 10 * hpcddp.rank()


def by_hand(reduce):
    return reduce(torch.stack([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(hpcddp.size())]))


@pytest.mark.parametrize(
    "op, reduce",
    [
        ("sum", lambda t: t.sum(0)),
        ("average", lambda t: t.mean(0)),
        ("min", lambda t: t.min(0).values),
        ("max", lambda t: t.max(0).values),
    ],
)
def test_allreduce_ops(op, reduce):
    mine = rank_tensor()
    out = hpcddp.allreduce(mine, op=op)
    torch.testing.assert_close(out, by_hand(reduce))
    torch.testing.assert_close(mine, rank_tensor()), "out-of-place allreduce changed its input"
    inplace = rank_tensor()
    assert hpcddp.allreduce_(inplace, op=op) is inplace
    torch.testing.assert_close(inplace, by_hand(reduce))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16])
def test_allreduce_sum_dtypes(dtype):
    out = hpcddp.allreduce(rank_tensor(dtype), op="sum")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), by_hand(lambda t: t.sum(0)))


def test_allreduce_out_of_place_keeps_shape_and_input_for_views_and_large_tensors():
    base = rank_tensor().t()  # a transposed view
    out = hpcddp.allreduce(base, op="sum")
    assert out.shape == base.shape
    torch.testing.assert_close(out, by_hand(lambda t: t.sum(0)).t())
    torch.testing.assert_close(base, rank_tensor().t())
    large = torch.arange(300_000, dtype=torch.float64) + hpcddp.rank()
    expected = sum(torch.arange(300_000, dtype=torch.float64) + r for r in range(hpcddp.size()))
    torch.testing.assert_close(hpcddp.allreduce(large, op="sum"), expected, rtol=0, atol=0)
    torch.testing.assert_close(large, torch.arange(300_000, dtype=torch.float64) + hpcddp.rank())


def test_allreduce_non_contiguous_in_place():
    base = rank_tensor().t()  # a transposed view
    hpcddp.allreduce_(base, op="sum")
    torch.testing.assert_close(base, by_hand(lambda t: t.sum(0)).t())


def test_async_handles_complete_in_any_wait_order():
    handles = [hpcddp.allreduce_async(torch.full((1000,), float(i + hpcddp.rank())), op="sum") for i in range(5)]
    n = hpcddp.size()
    for i, handle in reversed(list(enumerate(handles))):
        expected = n * i + n * (n - 1) / 2
        assert handle.wait()[0].item() == expected
        assert handle.poll()


def test_broadcast_from_every_root():
    for root in range(hpcddp.size()):
        mine = torch.full((3,), float(hpcddp.rank()))
        torch.testing.assert_close(hpcddp.broadcast(mine, root_rank=root), torch.full((3,), float(root)))
        assert mine[0].item() == hpcddp.rank()
        hpcddp.broadcast_(mine, root_rank=root)
        assert mine[0].item() == root


def test_broadcast_bad_root_names_argument():
    with pytest.raises(ValueError, match="root_rank must be in"):
        hpcddp.broadcast(torch.ones(1), root_rank=hpcddp.size())


def test_allgather_uneven_first_dimension():
    r = hpcddp.rank()
    out = hpcddp.allgather(torch.full((r + 1, 2), float(r)))
    expected = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(hpcddp.size())])
    torch.testing.assert_close(out, expected)


def test_object_collectives():
    assert hpcddp.broadcast_object({"from": hpcddp.rank()}, root_rank=0) == {"from": 0}
    assert hpcddp.allgather_object(("rank", hpcddp.rank())) == [("rank", k) for k in range(hpcddp.size())]


def test_average_of_integers_is_refused():
    with pytest.raises(TypeError, match="op='sum'"):
        hpcddp.allreduce(torch.ones(2, dtype=torch.int64), op="average")


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="op must be one of"):
        hpcddp.allreduce(torch.ones(2), op="median")


def test_parameters_reduce_and_broadcast_in_place():
    weight = torch.nn.Parameter(torch.full((3,), float(hpcddp.rank())))
    assert hpcddp.allreduce_(weight, op="max") is weight
    assert torch.equal(weight.detach(), torch.full((3,), float(hpcddp.size() - 1)))
    assert hpcddp.broadcast_(weight, root_rank=0) is weight
    assert torch.equal(weight.detach(), torch.full((3,), float(hpcddp.size() - 1)))
    assert weight.requires_grad


def test_gather_object_collects_on_the_root_only():
    comm = hpcddp.communicator()
    got = comm.gather_object(hpcddp.rank() * 3, 0)
    assert got == ([3 * k for k in range(hpcddp.size())] if hpcddp.rank() == 0 else None)
