"""monitored_barrier and group timeouts on the hpcddp backend, beside gloo's (see hpcddp.comm.mpi.monitored_barrier).

A failed gloo monitored_barrier leaves the ranks' gloo tags out of step for good, so
every gloo comparison here runs on a gloo group of its own, never used again.
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

TIMED_OUT = " (Timed out|closed|timeout) "  # what torch's suite expects of a group's timeout


def last_rank():
    return dist.get_world_size() - 1


def test_monitored_barrier_passes_on_every_rank(gloo):
    for group in (None, gloo):
        dist.monitored_barrier(group, timeout=timedelta(seconds=30))
        dist.monitored_barrier(group, timeout=timedelta(seconds=30), wait_all_ranks=True)


@pytest.mark.parametrize("backend", ["hpcddp", "gloo"])
def test_a_missing_rank_is_named_by_rank_0_and_the_others_hear_of_it(backend):
    group = None if backend == "hpcddp" else dist.new_group(backend="gloo")
    rank, missing = dist.get_rank(), last_rank()
    if rank == 0:
        with pytest.raises(RuntimeError, match=f"Rank {missing} failed to pass monitoredBarrier in 1000 ms"):
            dist.monitored_barrier(group, timeout=timedelta(seconds=1))
    elif rank != missing:
        expected = f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting"
        with pytest.raises(RuntimeError, match=expected):
            dist.monitored_barrier(group, timeout=timedelta(seconds=1))
    dist.barrier()
    if backend == "hpcddp":
        # Unlike gloo's, the rank that skipped a barrier is not a call behind afterwards.
        dist.monitored_barrier(timeout=timedelta(seconds=30))


@pytest.mark.parametrize("backend", ["hpcddp", "gloo"])
def test_a_rank_later_than_the_timeout_raises_soon_after_it_comes_and_every_other_rank_at_the_timeout(backend):
    # Its own group: the late rank's check-in may stay behind in it (see hpcddp.comm.mpi.monitored_barrier).
    group = dist.new_group(backend=backend)
    rank, late = dist.get_rank(), last_rank()
    if rank == late:
        time.sleep(2.5)
    started = time.monotonic()
    for_late = "rank 0 had given up on this rank" if backend == "hpcddp" else "Connection closed by peer"
    expected = {0: f"Rank {late} failed to pass monitoredBarrier in 1000 ms", late: for_late}
    with pytest.raises(RuntimeError, match=expected.get(rank, f"Rank {rank} successfully reached monitoredBarrier")):
        dist.monitored_barrier(group, timeout=timedelta(seconds=1))
    # gloo's late rank raises at once (rank 0 closed its pair); hpcddp's after one timeout more.
    assert time.monotonic() - started < 1 + 5
    dist.barrier()


@pytest.mark.parametrize("backend", ["hpcddp", "gloo"])
def test_wait_all_ranks_names_every_missing_rank(backend):
    group = None if backend == "hpcddp" else dist.new_group(backend="gloo")
    if dist.get_rank() == 0:
        missing = ", ".join(str(r) for r in range(1, dist.get_world_size()))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"Ranks {missing} failed to pass monitoredBarrier in 300 ms"):
            dist.monitored_barrier(group, timeout=timedelta(seconds=0.3), wait_all_ranks=True)
        assert time.monotonic() - started < 5  # one timeout for all of them, not one each
    dist.barrier()


def test_rank_0_without_time_left_says_it_timed_out():
    group = dist.new_group(backend="hpcddp")  # its own call count: the others never call it
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier"):
            group.monitored_barrier(timedelta(seconds=0))


@pytest.fixture
def group_timeouts(monkeypatch):
    monkeypatch.setenv("HPCDDP_GROUP_TIMEOUTS", "1")


def test_a_groups_timeout_is_not_enforced_unless_asked():
    group = dist.new_group(timeout=timedelta(seconds=0.2))
    if dist.get_rank() == 0:
        time.sleep(0.5)  # later than the timeout: the other ranks wait, as before
    total = torch.ones(3)
    dist.all_reduce(total, group=group)
    assert total.tolist() == [dist.get_world_size()] * 3
    dist.destroy_process_group(group)


@pytest.mark.parametrize("backend", ["hpcddp", "gloo"])
def test_a_groups_timeout_fails_its_collective_and_leaves_the_default_group_working(backend, group_timeouts):
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=1))
    if dist.get_rank() == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=TIMED_OUT):
            dist.barrier(group)
        assert 0.9 <= time.monotonic() - started < 10
        if backend == "hpcddp":
            # Out of step for good: every later operation says so, and none is paired with another.
            with pytest.raises(RuntimeError, match="all_reduce was not run: barrier on process group .* Timed out"):
                dist.all_reduce(torch.ones(1), group=group)
            with pytest.raises(RuntimeError, match="monitored_barrier was not run"):
                dist.monitored_barrier(group)
    total = torch.ones(2)
    dist.all_reduce(total)
    assert total.tolist() == [dist.get_world_size()] * 2


def test_a_groups_timeout_does_not_fail_a_collective_the_ranks_all_join(group_timeouts):
    group = dist.new_group(backend="hpcddp", timeout=timedelta(seconds=2))
    if dist.get_rank() == 0:
        time.sleep(0.5)  # late, but within the timeout
    total = torch.ones(3)
    dist.all_reduce(total, group=group)
    assert total.tolist() == [dist.get_world_size()] * 3
    dist.destroy_process_group(group)


def test_a_rank_later_than_the_timeout_times_out_too_instead_of_hanging(gloo, group_timeouts):
    # The others give up at 1 s and leave their agreement behind; the late rank's agreement
    # completes against it, and then it must not wait for data that never comes.
    group = dist.new_group(timeout=timedelta(seconds=1))
    if dist.get_rank() == last_rank():
        time.sleep(1.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=TIMED_OUT):
        dist.all_reduce(torch.ones(2), group=group)
    assert time.monotonic() - started < 10
    total = torch.ones(2)
    dist.all_reduce(total)  # the default group is its own communicator: still in step
    assert total.tolist() == [dist.get_world_size()] * 2


def test_a_receive_times_out_at_the_groups_timeout_and_takes_no_later_message(gloo, group_timeouts):
    group = dist.new_group(timeout=timedelta(seconds=1))
    rank = dist.get_rank()
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=TIMED_OUT):
            dist.recv(torch.zeros(2), src=1, group=group, tag=7)
        assert 0.9 <= time.monotonic() - started < 10
    dist.barrier()
    if rank == 1:
        dist.send(torch.full((2,), 5.0), dst=0, group=group, tag=7)
    elif rank == 0:
        later = torch.zeros(2)
        dist.recv(later, src=1, group=group, tag=7)  # the withdrawn receive did not take it
        assert later.tolist() == [5.0, 5.0]
    dist.destroy_process_group(group)
