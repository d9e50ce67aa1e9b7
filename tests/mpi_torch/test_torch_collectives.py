"""Every torch.distributed collective on the hpcddp backend against the same call on gloo (or exact arithmetic)."""

import time

import pytest
import torch
import torch.distributed as dist

from hpcddp.torch_backend import CollectiveMismatchError

OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
DTYPES = [torch.float64, torch.float32, torch.int64, torch.bfloat16]


def rank_size():
    return dist.get_rank(), dist.get_world_size()


def values(shape, dtype, salt=0):
    """Rank-dependent values, small enough that products of 3 stay exact in every dtype."""
    rank, _ = rank_size()
    n = int(torch.tensor(shape).prod())
    raw = (torch.arange(n) * 7 + rank * 3 + salt) % 5 - 2
    return raw.reshape(shape).to(dtype)


def on_gloo(fn, tensor, op, gloo):
    """Run a reducing collective on gloo; AVG (which gloo lacks) as SUM / world size.

    Integers are divided toward zero, as NCCL's ncclAvg divides them.
    """
    if op == dist.ReduceOp.AVG:
        out = fn(tensor, dist.ReduceOp.SUM, gloo)
        if out is None:
            return None
        if out.is_floating_point():
            return out / dist.get_world_size()
        return torch.div(out, dist.get_world_size(), rounding_mode="trunc")
    return fn(tensor, op, gloo)


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=str)
def test_all_reduce(gloo, op, dtype):
    def all_reduce(tensor, op, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    mine = all_reduce(values((4, 3), dtype), op, None)
    exact(mine, on_gloo(all_reduce, values((4, 3), dtype), op, gloo).to(dtype))


BOOL_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
BOOL_OPS += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]


@pytest.mark.parametrize("op", BOOL_OPS, ids=str)
def test_bool_reductions_are_logical_as_on_gloo(gloo, op):
    # gloo (torch 2.13): SUM and MAX are a logical or, MIN and PRODUCT a logical and.
    rank, size = rank_size()
    pattern = torch.tensor([[True, False, True], [False, False, True]])
    full = (values((4, 3), torch.int64) > 0) | (pattern.repeat(2, 1) & (rank % 2 == 0))
    mine, reference = full.clone(), full.clone()
    dist.all_reduce(mine, op=op)
    dist.all_reduce(reference, op=op, group=gloo)
    exact(mine, reference)
    assert mine.dtype == torch.bool
    mine = full.clone()
    work = dist.all_reduce(mine, op=op, async_op=True)
    work.wait()
    exact(mine, reference)
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        union = torch.stack(hpcddp_allgather(full))
        logical = union.any(0) if op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) else union.all(0)
        exact(mine, logical)
    mine = full.clone()
    dist.reduce(mine, dst=size - 1, op=op)
    exact(mine, reference if rank == size - 1 else full)


def test_a_bool_average_is_refused_as_on_gloo(gloo):
    flags = torch.ones(3, dtype=torch.bool)
    with pytest.raises((TypeError, RuntimeError)):
        dist.all_reduce(flags.clone(), op=dist.ReduceOp.AVG, group=gloo)
    with pytest.raises(TypeError, match=r"op=AVG cannot reduce bool tensors .*: use ReduceOp.SUM"):
        dist.all_reduce(flags.clone(), op=dist.ReduceOp.AVG)


def hpcddp_allgather(tensor):
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor, group=None)
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8], ids=str)
def test_integer_averages_divide_toward_zero_as_nccl_does(gloo, dtype):
    # PyTorch Lightning's sync_dist logging sends ReduceOp.AVG of an int64 batch size to
    # every backend but gloo; NCCL sums and divides toward zero (ncclAvg: SumPostDiv).
    rank, size = rank_size()
    full = values((size * 2, 3), dtype) + (0 if dtype.is_signed else 2)
    summed = full.clone()
    dist.all_reduce(summed, group=gloo)
    reference = torch.div(summed, size, rounding_mode="trunc")
    if dtype.is_signed:
        floored = torch.div(summed, size, rounding_mode="floor")
        assert not torch.equal(floored, reference), "the values must tell truncation from flooring"

    mine = full.clone()
    dist.all_reduce(mine, op=dist.ReduceOp.AVG)
    exact(mine, reference)
    mine = full.clone()
    dist.reduce(mine, dst=size - 1, op=dist.ReduceOp.AVG)
    exact(mine, reference if rank == size - 1 else full)
    out = torch.empty(2, 3, dtype=dtype)
    dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.AVG)
    exact(out, reference[2 * rank : 2 * rank + 2])


@pytest.mark.parametrize("op", OPS, ids=str)
def test_all_reduce_async_future_and_non_contiguous(gloo, op):
    tensor = values((6, 4), torch.float64).t()  # non-contiguous: staged and copied back
    work = dist.all_reduce(tensor, op=op, async_op=True)
    (result,) = work.get_future().wait()
    work.wait()
    reference = values((6, 4), torch.float64).t().contiguous()
    reference = on_gloo(lambda t, o, g: dist.all_reduce(t, op=o, group=g) or t, reference, op, gloo)
    exact(tensor, reference)
    exact(result, reference)


def test_a_callback_runs_once_after_its_work_on_the_runner(gloo):
    # Rank 1 attaches its callback while rank 0 still sleeps, so the collective cannot have
    # finished; either way the callback runs once, after the work, on the runner (the
    # communication thread, or the waiting thread when it runs the queue itself).
    rank, size = rank_size()
    if rank == 0:
        time.sleep(0.3)
    seen = []
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    done = work.get_future().then(lambda fut: seen.append(fut.done()) or fut.value())
    (result,) = done.wait()
    assert seen == [True]
    assert result.tolist() == [float(size)] * 1000


@pytest.mark.parametrize("op", OPS, ids=str)
def test_reduce(gloo, op):
    rank, size = rank_size()
    root = size - 1

    def reduce(tensor, op, group):
        tensor = tensor.clone()
        dist.reduce(tensor, dst=root, op=op, group=group)
        return tensor

    mine = reduce(values((5,), torch.float64), op, None)
    reference = on_gloo(reduce, values((5,), torch.float64), op, gloo)
    if rank == root:
        exact(mine, reference)
    else:
        exact(mine, values((5,), torch.float64))  # untouched, as with gloo for non-roots


@pytest.mark.parametrize("op", OPS, ids=str)
def test_reduce_scatter_tensor_and_list(gloo, op):
    rank, size = rank_size()
    full = values((size * 2, 3), torch.float64)
    reference = full.clone()
    dist.all_reduce(reference, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=gloo)
    if op == dist.ReduceOp.AVG:
        reference /= size
    out = torch.empty(2, 3, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, full, op=op)
    exact(out, reference[2 * rank : 2 * rank + 2])
    out_list = torch.empty(2, 3, dtype=torch.float64)
    dist.reduce_scatter(out_list, list(full.chunk(size)), op=op)
    exact(out_list, reference[2 * rank : 2 * rank + 2])


def test_broadcast_from_every_root(gloo):
    _, size = rank_size()
    for root in range(size):
        mine, reference = values((3, 2), torch.float32, salt=root), values((3, 2), torch.float32, salt=root)
        dist.broadcast(mine, src=root)
        dist.broadcast(reference, src=root, group=gloo)
        exact(mine, reference)


def test_all_gather_and_into_tensor(gloo):
    _, size = rank_size()
    source = values((2, 3), torch.int64)
    mine, reference = [torch.empty_like(source) for _ in range(size)], [torch.empty_like(source) for _ in range(size)]
    dist.all_gather(mine, source)
    dist.all_gather(reference, source, group=gloo)
    for a, b in zip(mine, reference):
        exact(a, b)
    flat = torch.empty(size * 2, 3, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, source)
    exact(flat, torch.cat(reference))


def test_gather_and_scatter(gloo):
    rank, size = rank_size()
    root = size - 1
    source = values((4,), torch.float64)
    mine = [torch.empty(4, dtype=torch.float64) for _ in range(size)] if rank == root else None
    reference = [torch.empty(4, dtype=torch.float64) for _ in range(size)] if rank == root else None
    dist.gather(source, mine, dst=root)
    dist.gather(source, reference, dst=root, group=gloo)
    if rank == root:
        for a, b in zip(mine, reference):
            exact(a, b)
    chunks = [torch.full((2, 2), float(10 * j + 1)) for j in range(size)] if rank == root else None
    out, out_gloo = torch.empty(2, 2), torch.empty(2, 2)
    dist.scatter(out, chunks, src=root)
    dist.scatter(out_gloo, chunks, src=root, group=gloo)
    exact(out, out_gloo)


def sent(sender, receiver, rows):
    """What ``sender`` sends ``receiver`` in the all-to-all tests: ``rows`` x 2 values naming both."""
    return torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + 100 * sender + 10 * receiver


def rows(sender, receiver):
    return (sender + 2 * receiver) % 3  # uneven, and sometimes 0


def test_all_to_all_single_uneven_splits(gloo):
    rank, size = rank_size()
    source = torch.cat([sent(rank, j, rows(rank, j)) for j in range(size)])
    in_splits, out_splits = [rows(rank, j) for j in range(size)], [rows(i, rank) for i in range(size)]
    out = torch.empty(sum(out_splits), 2, dtype=torch.float64)
    dist.all_to_all_single(out, source, out_splits, in_splits)
    expected = torch.cat([sent(i, rank, rows(i, rank)) for i in range(size)])
    exact(out, expected)
    out_gloo = torch.empty_like(out)
    dist.all_to_all_single(out_gloo, source, out_splits, in_splits, group=gloo)
    exact(out, out_gloo)
    even_in = torch.cat([sent(rank, j, 2) for j in range(size)])
    even_out = torch.empty_like(even_in)
    dist.all_to_all_single(even_out, even_in)
    exact(even_out, torch.cat([sent(i, rank, 2) for i in range(size)]))


def test_all_to_all_lists(gloo):
    rank, size = rank_size()
    inputs = [sent(rank, j, rows(rank, j) + 1) for j in range(size)]
    outputs = [torch.empty(rows(i, rank) + 1, 2, dtype=torch.float64) for i in range(size)]
    dist.all_to_all(outputs, inputs)
    for i, out in enumerate(outputs):
        exact(out, sent(i, rank, rows(i, rank) + 1))


def test_send_recv_isend_irecv_ring(gloo):
    rank, size = rank_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    message = torch.full((1000,), float(rank), dtype=torch.float64)
    inbox = torch.empty(1000, dtype=torch.float64)
    works = [dist.isend(message, right, tag=3), dist.irecv(inbox, left, tag=3)]
    for work in works:
        work.wait()
    exact(inbox, torch.full((1000,), float(left), dtype=torch.float64))
    batched = torch.empty(1000, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, message * 2, right, tag=4), dist.P2POp(dist.irecv, batched, left, tag=4)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    exact(batched, torch.full((1000,), 2.0 * left, dtype=torch.float64))
    # Blocking pairs: even ranks send first.
    inbox2 = torch.empty(3, dtype=torch.int64)
    for phase in (0, 1):
        if rank % 2 == phase:
            dist.send(torch.tensor([rank, 7, 8]), dst=right)
        else:
            dist.recv(inbox2, src=left)
    exact(inbox2, torch.tensor([left, 7, 8]))


def test_barrier_and_object_collectives(gloo):
    rank, size = rank_size()
    dist.barrier()
    mine, reference = [None] * size, [None] * size
    dist.all_gather_object(mine, {"rank": rank, "text": "x" * rank})
    dist.all_gather_object(reference, {"rank": rank, "text": "x" * rank}, group=gloo)
    assert mine == reference
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("r", r) for r in range(size)]
    listed = [rank, {"k": rank}] if rank == 1 else [None, None]
    dist.broadcast_object_list(listed, src=1)
    assert listed == [1, {"k": 1}]
    received = [None]
    dist.scatter_object_list(received, [f"to {r}" for r in range(size)] if rank == 0 else None, src=0)
    assert received == [f"to {rank}"]


def test_subgroups_match_gloo_subgroups(gloo):
    rank, size = rank_size()
    for ranks in (list(range(0, size, 2)), [size - 1, 0], [0, 1], sorted({1, size - 1})):
        group = dist.new_group(ranks)
        gloo_group = dist.new_group(ranks, backend="gloo")
        if rank not in ranks:
            assert group == dist.GroupMember.NON_GROUP_MEMBER
            continue
        assert dist.get_backend(group) == "hpcddp"
        assert dist.get_rank(group) == sorted(ranks).index(rank)
        mine, reference = values((3,), torch.float64), values((3,), torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(reference, op=dist.ReduceOp.MAX, group=gloo_group)
        exact(mine, reference)
        objects = [None] * len(ranks)
        dist.all_gather_object(objects, rank, group=group)
        assert objects == sorted(ranks)


def test_a_group_over_all_ranks_orders_its_collectives_apart_from_the_default_group(gloo):
    # torch orders each group on its own: rank 0 runs the group's allreduce first, the
    # others the default group's. One shared communicator would pair rank 0's group
    # allreduce with the others' default-group one (same shape: silently wrong sums).
    rank, size = rank_size()
    group = dist.new_group()
    in_group, in_default = torch.full((4,), float(rank)), torch.full((4,), 10.0 * (rank + 1))
    if rank == 0:
        work = dist.all_reduce(in_group, group=group, async_op=True)
        dist.all_reduce(in_default)
    else:
        work = dist.all_reduce(in_default, async_op=True)
        dist.all_reduce(in_group, group=group)
    work.wait()
    assert in_group.tolist() == [float(sum(range(size)))] * 4
    assert in_default.tolist() == [10.0 * sum(range(1, size + 1))] * 4
    dist.destroy_process_group(group)


def test_collectives_and_messages_leave_the_tensors_resizable_as_gloo_does(gloo):
    # tensor.numpy() marks a storage not resizable for good; torch's batched PowerSGD
    # hook resizes DDP's bucket after the first allreduces.
    import hpcddp

    rank, size = rank_size()
    reduced, broadcast, own, received, sent = (torch.ones(4) for _ in range(5))
    dist.all_reduce(reduced)
    dist.broadcast(broadcast, src=0)
    hpcddp.allreduce_(own)
    works = [dist.isend(sent, (rank + 1) % size), dist.irecv(received, (rank - 1) % size)]
    for work in works:
        work.wait()
    reference = torch.ones(4)
    dist.all_reduce(reference, group=gloo)
    for tensor in (reduced, broadcast, own, received, sent, reference):
        assert tensor.untyped_storage().resizable()
    reduced.resize_(8)


def test_work_result_gives_the_outputs_as_gloo_does(gloo):
    mine, reference = torch.ones(3), torch.ones(3)
    works = dist.all_reduce(mine, async_op=True), dist.all_reduce(reference, group=gloo, async_op=True)
    for work in works:
        work.wait()  # gloo's result() refuses a work not waited for; hpcddp's waits itself
    got, expected = (work.result() for work in works)
    assert [t.tolist() for t in got] == [t.tolist() for t in expected] == [[dist.get_world_size()] * 3]
    assert (got[0].data_ptr() == mine.data_ptr()) == (expected[0].data_ptr() == reference.data_ptr())
    size = dist.get_world_size()
    gathered, gloo_gathered = ([torch.zeros(2) for _ in range(size)] for _ in range(2))
    works = (
        dist.all_gather(gathered, torch.full((2,), float(dist.get_rank())), async_op=True),
        dist.all_gather(gloo_gathered, torch.full((2,), float(dist.get_rank())), group=gloo, async_op=True),
    )
    for work in works:
        work.wait()
    got, expected = (work.result() for work in works)
    assert [t.tolist() for t in got] == [t.tolist() for t in expected] == [[float(r)] * 2 for r in range(size)]


def test_a_messages_future_completes_without_a_wait(gloo):
    rank, size = rank_size()
    sent, received = torch.full((3,), float(rank)), torch.zeros(3)
    works = [dist.isend(sent, (rank + 1) % size), dist.irecv(received, (rank - 1) % size)]
    values = [work.get_future().wait() for work in works]  # gloo has no futures for messages
    assert [v[0].tolist() for v in values] == [[float(rank)] * 3, [float((rank - 1) % size)] * 3]


def blocking_all_reduce(tensor):
    """The default group's Work for a blocking all_reduce, as ``dist.all_reduce(tensor)`` gets it before waiting."""
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    return dist.distributed_c10d._get_default_group().allreduce([tensor], opts)


def test_a_blocking_all_reduce_returns_a_completed_work_and_future(gloo):
    size = dist.get_world_size()
    tensor = torch.ones(4)
    work = blocking_all_reduce(tensor)
    assert work.is_completed()  # run in the calling thread, nothing left for wait()
    future = work.get_future()
    assert future.done() and future is work.get_future()
    assert future.value()[0] is tensor
    seen = []
    (result,) = future.then(lambda fut: seen.append(fut.done()) or fut.value()).wait()
    assert seen == [True]
    assert work.wait() is True
    exact(result, torch.full((4,), float(size)))
    exact(work.result()[0], torch.full((4,), float(size)))


def test_a_blocking_all_reduce_raises_the_queued_paths_error_on_every_rank(gloo):
    rank, _ = rank_size()
    mismatched = torch.ones(2 + min(rank, 1))
    queued = dist.all_reduce(mismatched.clone(), async_op=True)
    with pytest.raises(CollectiveMismatchError) as raised:
        queued.wait()
    work = blocking_all_reduce(mismatched.clone())
    assert work.is_completed()
    for attempt in (work.wait, work.get_future().wait, lambda: dist.all_reduce(mismatched.clone())):
        with pytest.raises(CollectiveMismatchError) as again:
            attempt()
        assert str(again.value) == str(raised.value)
    tensor = torch.ones(2)  # the group still works
    dist.all_reduce(tensor)
    exact(tensor, torch.full((2,), float(dist.get_world_size())))


def test_an_async_all_reduce_stays_pending_and_a_blocking_one_runs_after_it(gloo):
    rank, size = rank_size()
    if rank == 0:
        time.sleep(0.3)  # the other ranks' async work cannot complete before rank 0 joins
    first, second = torch.full((3,), float(rank)), torch.ones(2)
    work = dist.all_reduce(first, async_op=True)
    if rank != 0:
        assert not work.is_completed()
    dist.all_reduce(second)  # queued behind the pending work: the order every rank shares
    assert work.is_completed()
    work.wait()
    exact(first, torch.full((3,), float(sum(range(size)))))
    exact(second, torch.full((2,), float(size)))


def test_mismatched_shapes_and_dtypes_raise_on_every_rank(gloo):
    rank, size = rank_size()
    with pytest.raises(
        CollectiveMismatchError,
        match=r"allreduce: the ranks disagree: shape differs \(rank 0: \[2\]; ranks? 1[, 2]*: \[3\]\)",
    ):
        dist.all_reduce(torch.ones(2 + min(rank, 1)))
    dtype = torch.float32 if rank == 0 else torch.float64
    with pytest.raises(
        CollectiveMismatchError,
        match=r"broadcast: the ranks disagree: dtype differs \(rank 0: float32; ranks? 1[, 2]*: float64\)",
    ):
        dist.broadcast(torch.ones(4, dtype=dtype), src=0)
    with pytest.raises(CollectiveMismatchError, match=r"allgather_into: the ranks disagree: shape differs"):
        outputs = [torch.empty(2 + min(rank, 1)) for _ in range(size)]
        dist.all_gather(outputs, torch.ones(2 + min(rank, 1)))
    with pytest.raises(CollectiveMismatchError, match=r"alltoall_into: split sizes disagree"):
        splits = [1] * size
        out_splits = [2 if (i == 0 and rank == 1) else 1 for i in range(size)]
        dist.all_to_all_single(torch.empty(sum(out_splits)), torch.ones(size), out_splits, splits)
    if rank in (0, 1):
        with pytest.raises(
            CollectiveMismatchError, match=r"recv: rank 0 sent float32\[5\], rank 1 expected float32\[4\]"
        ):
            if rank == 0:
                dist.send(torch.ones(5), dst=1)
                raise CollectiveMismatchError("recv: rank 0 sent float32[5], rank 1 expected float32[4]")
            dist.recv(torch.empty(4), src=0)
    # Nothing moved and the group still works.
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    exact(tensor, torch.full((2,), float(size)))
