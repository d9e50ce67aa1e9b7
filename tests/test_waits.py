"""How a rank waits for an MPI request (hpcddp.comm.mpi.waits): fake requests, no MPI."""

import time

import pytest

from hpcddp.comm.mpi import waits

pytestmark = pytest.mark.unit


class Request:
    """Completes at its ``tests``-th ``Test``, as mpi4py's request does when the peers arrive."""

    def __init__(self, tests: int) -> None:
        self.left = tests

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.left -= 1
        return self.left <= 0


def test_a_yield_that_lost_the_core_turns_the_wait_to_sleeps(monkeypatch):
    # A yield that comes back 1 ms late: another process had the core. Yielding again would
    # hand it away for another time slice each test; a short sleep wakes on time.
    calls = []
    real_sleep = time.sleep

    def late_yield():
        calls.append("yield")
        real_sleep(1e-3)

    monkeypatch.setattr(waits.os, "sched_yield", late_yield)
    monkeypatch.setattr(waits.time, "sleep", lambda s: (calls.append("sleep"), real_sleep(s)))
    monkeypatch.setattr(waits, "_hot_spin_s", 0.0)
    monkeypatch.setattr(waits, "_spin_s", 1.0)
    assert waits.wait_for_request(Request(tests=6))
    assert calls[0] == "yield" and calls[1:] == ["sleep"] * (len(calls) - 1) and len(calls) == 4


def test_a_peer_arriving_at_once_is_waited_for_without_yielding(monkeypatch):
    yields = []
    monkeypatch.setattr(waits.os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(waits, "_hot_spin_s", 10.0)  # no tight timing: the hot phase outlasts any test
    assert waits.wait_for_request(Request(tests=50))
    assert yields == []


def test_ranks_sharing_cores_yield_from_the_first_test():
    try:
        waits.share_cores(True)
        assert waits._hot_spin_s == 0.0 and waits._spin_s == waits._SHARED_CORES_SPIN_S
        waits.share_cores(False)
        assert waits._hot_spin_s == waits._HOT_SPIN_S and waits._spin_s == waits._SPIN_S
    finally:
        waits.share_cores(False)
