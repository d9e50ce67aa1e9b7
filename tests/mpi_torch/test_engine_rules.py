"""The rules of hpcddp.comm.mpi.engine as users meet them: two APIs on one communicator, torch's comm
hooks that issue collectives from future callbacks, messages that complete by themselves,
groups that come and go. References: gloo over the same ranks, plain arithmetic.
"""

import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcddp

# The default group ("hpcddp") and the gloo reference beside it.
pytestmark = pytest.mark.usefixtures("gloo")


def rank_size():
    return dist.get_rank(), dist.get_world_size()


# ---- two APIs on one communicator ---------------------------------------------------------------


def test_torch_all_reduce_on_one_rank_matches_hpcddp_allreduce_on_the_others():
    rank, size = rank_size()
    tensor = torch.arange(6.0) * (rank + 1)
    if rank == 0:
        dist.all_reduce(tensor)
    else:
        hpcddp.allreduce_(tensor, op="sum")
    expected = torch.arange(6.0) * sum(r + 1 for r in range(size))
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


def test_torch_barrier_matches_hpcddp_barrier_and_a_mismatch_is_an_error_everywhere():
    rank, _ = rank_size()
    if rank == 0:
        dist.barrier()
    else:
        hpcddp.barrier()
    with pytest.raises(hpcddp.CollectiveMismatchError, match=r"ranks? 1[, \d]*: barrier"):
        if rank == 0:
            dist.all_reduce(torch.ones(3))
        else:
            hpcddp.barrier()
    tensor = torch.ones(2)
    dist.all_reduce(tensor)  # nothing moved, the communicator still works
    assert tensor.tolist() == [float(dist.get_world_size())] * 2


def test_hpcddp_scatter_beside_torch_scatter_is_an_error_everywhere_not_a_hang():
    # hpcddp's scatter sends the root's sizes first: it agrees before that message too (rule 4).
    rank, size = rank_size()
    comm = hpcddp.communicator()
    chunks = [torch.ones(3)] * size
    with pytest.raises(hpcddp.CollectiveMismatchError, match="op differs"):
        if rank == 0:
            dist.scatter(torch.empty(3), chunks, src=0)
        else:
            comm.scatter_async_(torch.empty(3), None, 0, check="").wait()
    out = torch.empty(3)
    comm.scatter_async_(out, chunks if rank == 0 else None, 0, check="").wait()
    assert out.tolist() == [1.0] * 3


def test_broadcast_object_with_different_roots_is_an_error_everywhere():
    rank, size = rank_size()
    with pytest.raises(hpcddp.CollectiveMismatchError, match="root differs"):
        hpcddp.broadcast_object(f"from {rank}", root_rank=rank % 2)
    assert hpcddp.broadcast_object(f"from {rank}", root_rank=size - 1) == f"from {size - 1}"


# ---- torch's comm hooks: collectives issued and waited for inside future callbacks ----------------


def _model():
    torch.manual_seed(7)
    # One bucket: torch's PowerSGD hook over CPU gloo completes only with one (several hang there).
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5)).double()


def _train(ddp, steps=6, averager=None):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(11 + dist.get_rank())
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(16, 20, dtype=torch.float64, generator=generator)
        F.mse_loss(ddp(x), torch.zeros(16, 5, dtype=torch.float64)).backward()
        optimizer.step()
        if averager is not None:
            averager.average_parameters(ddp.parameters())
    return [p.detach().clone() for p in ddp.parameters()]


def _powersgd(group):
    state = powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2, warm_start=True
    )
    return state, powerSGD_hook.powerSGD_hook


def _fp16(group):
    return group, default_hooks.fp16_compress_hook


def _post_local_sgd(group):
    # Local steps without any communication after the third (subgroups of one rank), averaged every 2.
    subgroup, _ = dist.new_subgroups(group_size=1, backend="gloo" if group is not None else None)
    return PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=3), post_localSGD_hook


@pytest.mark.parametrize("make_hook", [_powersgd, _fp16, _post_local_sgd], ids=["powerSGD", "fp16", "post-localSGD"])
def test_ddp_comm_hooks_end_where_they_end_over_gloo(gloo, make_hook):
    results = []
    for group in (None, gloo):  # the hpcddp default group, then gloo over the same ranks
        ddp = DDP(_model(), process_group=group, bucket_cap_mb=25)
        ddp.register_comm_hook(*make_hook(group))
        averager = None
        if make_hook is _post_local_sgd:
            averager = PeriodicModelAverager(period=2, warmup_steps=3, process_group=group)
        results.append(_train(ddp, averager=averager))
    # fp16 sums of three or more ranks round differently in another order (MPI's vs gloo's).
    exact = make_hook is not _fp16 or dist.get_world_size() == 2
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine, reference, rtol=1e-12 if exact else 1e-3, atol=1e-12 if exact else 1e-5)


@pytest.mark.parametrize("rank_that_finishes_first", [0, 1])
def test_a_callback_issues_its_collective_at_the_same_point_whenever_its_work_completed(
    rank_that_finishes_first,
):
    rank, size = rank_size()
    later = torch.full((3,), 10.0 * (rank + 1))
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    work_after = dist.all_reduce(later, async_op=True)
    if rank == rank_that_finishes_first:
        work_after.wait()  # here both works are done before the callback is attached; elsewhere not
    issued = {}

    def issue(_future):
        issued["value"] = torch.full((3,), float(rank + 1))
        dist.all_reduce(issued["value"])  # same shape as `later`: a swap would pass the agreement
        return issued["value"]

    work.get_future().then(issue).wait()
    work_after.wait()
    assert issued["value"].tolist() == [float(sum(range(1, size + 1)))] * 3
    assert later.tolist() == [10.0 * sum(range(1, size + 1))] * 3


def test_a_callback_may_wait_for_a_work_submitted_after_it():
    _, size = rank_size()
    later, attached = {}, threading.Event()

    def wait_for_the_later_work(_future):
        if threading.current_thread() is threading.main_thread() and not attached.is_set():
            return None  # the work had finished and the queue was idle: it ran at once, in then()
        attached.wait(30)
        return later["work"].get_future().wait()

    # 4 MB: still being reduced when the callback is attached (queued), almost always.
    chained = dist.all_reduce(torch.ones(1 << 20), async_op=True).get_future().then(wait_for_the_later_work)
    later["work"] = dist.all_reduce(torch.full((2,), 2.0), async_op=True)
    attached.set()
    result = chained.wait()
    assert result is None or result[0].tolist() == [2.0 * size] * 2
    later["work"].wait()


def test_ctrl_c_in_a_callback_that_runs_at_once_stops_the_attaching_thread():
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    time.sleep(0.05)  # the queue is idle: then() runs the callback here and now, as torch does

    def interrupted(_future):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        work.get_future().then(interrupted)
    chained = work.get_future().then(lambda future: future.value()[0] * 2)
    assert chained.done() and chained.wait().tolist() == [2.0 * dist.get_world_size()] * 2


# ---- point-to-point messages complete by themselves ---------------------------------------------


def test_isend_and_irecv_complete_without_wait():
    rank, size = rank_size()
    if rank > 1:
        return
    tensor = torch.full((5,), float(rank))
    work = dist.isend(tensor, 1) if rank == 0 else dist.irecv(tensor, 0)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert work.is_completed()
    work.wait()
    assert tensor.tolist() == [0.0] * 5


def test_recv_from_any_rank_returns_the_sender():
    rank, size = rank_size()
    if rank == 0:
        got = {}
        for _ in range(size - 1):
            buffer = torch.empty(3)
            got[dist.recv(buffer, src=None)] = buffer
        assert sorted(got) == list(range(1, size))
        for sender, values in got.items():
            assert values.tolist() == [float(sender)] * 3
    else:
        dist.send(torch.full((3,), float(rank)), dst=0)


def test_a_receive_from_any_rank_beside_one_from_rank_0_takes_the_messages_in_order():
    rank, _ = rank_size()
    if rank == 0:
        for value in (1.0, 2.0, 3.0):
            dist.send(torch.full((4,), value), 1)
    elif rank == 1:
        first, second, third = torch.zeros(4), torch.zeros(4), torch.zeros(4)
        works = [dist.irecv(first), dist.irecv(second, src=0), dist.irecv(third)]
        for work in reversed(works):  # tested in the other order: the data must not follow the test order
            work.wait()
        assert [first[0].item(), second[0].item(), third[0].item()] == [1.0, 2.0, 3.0]
    dist.barrier()


def test_a_large_message_reaches_a_rank_that_waits_in_a_collective():
    rank, size = rank_size()
    count = 1 << 21  # 8 MB: sent by rendezvous, so the send completes only once the data is received
    if rank == 0:
        dist.send(torch.arange(count, dtype=torch.float32), 1)  # blocks until rank 1 takes it
    if rank == 1:
        big = torch.zeros(count)
        work = dist.irecv(big)  # from any rank; its header arrives while this rank waits below
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == size
    if rank == 1:
        work.wait()
        torch.testing.assert_close(big, torch.arange(count, dtype=torch.float32), rtol=0, atol=0)


def test_a_receive_of_the_wrong_shape_raises_and_leaves_the_tensor_alone():
    rank, _ = rank_size()
    if rank == 0:
        work = dist.isend(torch.full((5,), 9.0), 1)
    elif rank == 1:
        mine = torch.full((3,), 7.0)
        with pytest.raises(hpcddp.CollectiveMismatchError, match=r"rank 0 sent float32\[5\], rank 1 expected"):
            dist.recv(mine, 0)
        assert mine.tolist() == [7.0] * 3
    if rank == 0:
        work.wait()
    dist.barrier()


# ---- groups come and go -------------------------------------------------------------------------


def test_new_and_destroyed_groups_leave_no_thread_or_communicator_behind():
    from hpcddp.comm import oplog

    _, size = rank_size()
    ranks = [0, 1]
    # Optimizers dropped by earlier tests close their buckets' communicator (and its thread) when collected.
    gc.collect()
    before_threads, before_logs = threading.active_count(), len(oplog.logs())
    for _ in range(20):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            tensor = torch.ones(2)
            dist.all_reduce(tensor, group=group)
            assert tensor.tolist() == [2.0, 2.0]
        dist.destroy_process_group(group)
    assert threading.active_count() == before_threads
    assert len(oplog.logs()) == before_logs
    assert size >= 2
