"""Profiler events, coalesced collectives and refused inputs of the hpcddp backend, against gloo."""

import pytest
import torch
import torch.distributed as dist


def comm_events(prefix, call):
    """``call()`` under torch.profiler: (op, input shapes, asynchronous) of each ``prefix:op`` event."""
    with torch.profiler.profile(record_shapes=True) as prof:
        works = call()
        for work in works or []:
            work.wait()
    found = [e for e in prof.events() if e.name.startswith(prefix + ":")]
    return sorted((e.name.split(":", 1)[1], [list(s) for s in e.input_shapes], e.is_async) for e in found)


def collectives(group):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(3, 2) * rank
    return [
        lambda: dist.all_reduce(x.clone(), group=group),
        lambda: [dist.all_reduce(x.clone(), group=group, async_op=True)],
        lambda: dist.broadcast(x.clone(), src=0, group=group),
        lambda: dist.reduce(x.clone(), dst=0, group=group),
        lambda: dist.all_gather([torch.empty(3, 2) for _ in range(size)], x, group=group),
        lambda: dist.all_to_all(
            [torch.empty(1, 2) for _ in range(size)], [x[:1].clone() for _ in range(size)], group=group
        ),
        lambda: dist.barrier(group=group),
        lambda: [
            dist.isend(x.clone(), (rank + 1) % size, group=group),
            dist.irecv(torch.empty(3, 2), (rank - 1) % size, group=group),
        ],
    ]


@pytest.mark.parametrize("index", range(8))
def test_each_operation_records_the_event_gloo_records(gloo, index):
    mine = comm_events(dist.get_backend(), collectives(None)[index])
    assert mine and all(is_async for _, _, is_async in mine)
    try:
        reference = comm_events("gloo", collectives(gloo)[index])
    except RuntimeError as err:
        if "does not support" not in str(err):  # torch < 2.13: "Backend gloo does not support alltoall"
            raise
        pytest.skip(f"no reference: torch {torch.__version__}: {err}")
    assert mine == reference


def test_all_gather_coalesced_matches_gloo(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = [torch.arange(3.0) + 10 * rank, torch.full((2, 2), float(rank)), torch.tensor([rank * 1j + 1])]

    def gathered(group):
        outputs = [[torch.empty_like(t) for t in inputs] for _ in range(size)]
        dist.all_gather_coalesced(outputs, inputs, group=group)
        return outputs

    mine, reference = gathered(None), gathered(gloo)
    for mine_row, reference_row in zip(mine, reference):
        for a, b in zip(mine_row, reference_row):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # rank r's second input, from the independent arithmetic too
    for r in range(size):
        torch.testing.assert_close(mine[r][1], torch.full((2, 2), float(r)), rtol=0, atol=0)


def test_all_gather_coalesced_with_wrong_lists_names_the_argument():
    size = dist.get_world_size()
    with pytest.raises(ValueError, match=r"output_tensor_lists must hold world_size=\d+ lists"):
        dist.all_gather_coalesced([[torch.empty(2)] for _ in range(size + 1)], [torch.ones(2)])


def test_sparse_all_reduce_is_refused_with_the_fix():
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (4,))
    with pytest.raises(ValueError, match=r"sparse_coo tensor is not supported .*to_dense\(\)"):
        dist.all_reduce(sparse)


def test_an_event_ends_when_its_operation_ends_as_gloo_s_do(gloo):
    import time

    def durations(prefix, group):
        with torch.profiler.profile() as prof:
            dist.all_reduce(torch.ones(4), group=group)
            time.sleep(0.3)  # the profiler stays on well after the operation ended
        return [e.cpu_time_total for e in prof.events() if e.name.startswith(prefix + ":all_reduce")]

    mine, reference = durations(dist.get_backend(), None), durations("gloo", gloo)
    assert len(mine) == len(reference) == 1
    assert mine[0] < 100_000 and reference[0] < 100_000, (mine, reference)  # microseconds


def test_a_continuation_that_waits_for_its_works_under_the_profiler_returns():
    # A future's callbacks run inline where it completes (the runner): when the future was completed
    # before the work's profiler event ended, a callback that waits for the work waited for ever (review).
    size = dist.get_world_size()
    with torch.profiler.profile():
        for _ in range(3):
            a, b = torch.ones(4), torch.full((4,), 2.0)
            work_a, work_b = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
            both = torch.futures.collect_all([work_a.get_future(), work_b.get_future()])

            def add(_, works=(work_a, work_b), tensors=(a, b)):
                for work in works:
                    work.wait()  # inline on the runner, where the future completed
                return sum(t[0].item() for t in tensors)

            assert both.then(add).wait() == 3.0 * size


def test_operations_in_flight_when_the_profiler_stops_end_safely():
    rank, size = dist.get_rank(), dist.get_world_size()
    for _ in range(20):
        with torch.profiler.profile():
            pending = dist.irecv(torch.empty(3), (rank - 1) % size)
        dist.send(torch.ones(3), (rank + 1) % size)
        pending.wait()
    dist.barrier()


def test_async_all_gather_coalesced_fails_its_future_on_a_mismatch():
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = [torch.ones(2 + rank)]  # shapes differ between ranks
    outputs = [[torch.empty(2 + r)] for r in range(size)]
    future = dist.all_gather_coalesced(outputs, inputs, async_op=True)  # torch returns the future itself
    with pytest.raises(Exception, match="allgather"):
        future.wait()


def test_coalesced_reduce_scatter_blocking_matches_gloo(gloo):
    # torch hands each part of a blocking coalesced reduce_scatter its blocking options: the parts
    # must still return Works the coalescing chains (a completed one broke it: AttributeError).
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = [torch.arange(2.0 * size) + 10 * rank, torch.full((3 * size,), float(rank + 1))]

    def reduced(group):
        outputs = [torch.empty(2), torch.empty(3)]
        with dist._coalescing_manager(group=group):
            for out, source in zip(outputs, inputs):
                dist.reduce_scatter_tensor(out, source, group=group)
        return outputs

    mine, reference = reduced(None), reduced(gloo)
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(mine[1], torch.full((3,), size * (size + 1) / 2), rtol=0, atol=0)
