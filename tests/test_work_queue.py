"""The MPI backend's work queue: one runner at a time, in order; a waiter may run queued work itself."""

import threading

from hpcddp.comm._workqueue import WorkQueue as _WorkQueue


def test_steal_takes_the_next_item_only_when_nobody_runs_one():
    q = _WorkQueue()
    q.put("a")
    q.put("b")
    assert q.steal() == "a"
    assert q.steal() is None  # "a" is still running
    q.release()
    assert q.steal() == "b"
    q.release()
    assert q.steal() is None  # empty


def test_get_waits_for_a_stolen_item_to_finish():
    q = _WorkQueue()
    q.put("a")
    q.put("b")
    assert q.steal() == "a"
    got = []
    runner = threading.Thread(target=lambda: got.append(q.get()))
    runner.start()
    runner.join(0.2)
    assert runner.is_alive() and got == []  # "b" may not start while "a" runs
    q.release()
    runner.join(5)
    assert got == ["b"]


def test_close_marker_is_never_stolen():
    q = _WorkQueue()
    q.put(None)
    assert q.steal() is None
    assert q.get() is None


def test_put_without_wake_leaves_the_item_to_the_waiter():
    q = _WorkQueue()
    got = []
    runner = threading.Thread(target=lambda: got.append(q.get()), daemon=True)
    runner.start()
    runner.join(0.1)
    q.put("mine", wake=False)
    runner.join(0.2)
    assert got == [] and q.steal() == "mine"
    q.release()
    q.put("theirs")  # a normal put wakes the runner
    runner.join(5)
    assert got == ["theirs"]


def test_claim_only_when_idle_and_empty():
    q = _WorkQueue()
    assert q.claim()
    assert not q.claim() and q.steal() is None  # the claimer runs
    q.release()
    q.put("queued")
    assert not q.claim()  # queued work must run first, in order
