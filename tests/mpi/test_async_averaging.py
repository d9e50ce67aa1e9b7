"""AsyncModelAverager on every rank: close() ends on plain mpi4py's average, a slow rank slows no one."""

import time

import numpy as np
import pytest
import torch

import hpcddp

from .test_averaging import local_step

FAST_PAUSE_S, SLOW_PAUSE_S = 0.002, 0.02


def rank_model():
    torch.manual_seed(7 + hpcddp.rank())  # the averager must start every rank from rank 0's weights
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def floating_state(model) -> np.ndarray:
    """The model's floating parameters and buffers, flat, in the averager's order."""
    tensors = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def mpi4py_average(array: np.ndarray) -> np.ndarray:
    """The reference: a SUM over every rank with plain mpi4py, divided by the number of ranks."""
    from mpi4py import MPI

    total = array.copy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return total / np.float32(MPI.COMM_WORLD.Get_size())


def same_on_every_rank(array: np.ndarray) -> bool:
    return all(np.array_equal(other, array) for other in hpcddp.allgather_object(array))


def train_for(model, optimizer, seconds: float, slow_rank: int | None = None) -> int:
    """Step until ``seconds`` pass on this rank's clock (from a common start); return the steps taken."""
    pause = SLOW_PAUSE_S if hpcddp.rank() == slow_rank else FAST_PAUSE_S
    hpcddp.barrier()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        local_step(model, optimizer, steps)
        time.sleep(pause)
        steps += 1
    return steps


def test_starts_from_rank_0_and_closes_on_plain_mpi4py_average_of_the_last_local_models():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    assert same_on_every_rank(floating_state(model))
    steps = train_for(model, optimizer, 0.3)
    averager.pause()
    for step in range(3 + hpcddp.rank()):  # local steps with nothing in flight: the ranks drift apart
        local_step(model, optimizer, 100 + step)
    last_local = floating_state(model)
    assert not same_on_every_rank(last_local) or hpcddp.size() == 1
    expected = mpi4py_average(last_local)
    averager.close()
    closed = floating_state(model)
    assert same_on_every_rank(closed), "close() must leave bitwise identical models"
    np.testing.assert_allclose(closed, expected, rtol=1e-6, atol=1e-7)
    # Integer buffers stay each rank's own: BatchNorm counted this rank's steps only.
    assert int(model[1].num_batches_tracked) == steps + 3 + hpcddp.rank()
    averager.close()  # idempotent
    steps = averager.num_steps
    local_step(model, optimizer, 200)
    assert averager.num_steps == steps, "close() removes the step hooks"


def test_a_slow_rank_slows_no_one_and_the_models_stay_close():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averager = hpcddp.AsyncModelAverager(model, optimizer, warmup_steps=2)
    slow = hpcddp.size() - 1
    steps = train_for(model, optimizer, 1.0, slow_rank=slow)
    averager.pause()
    all_steps = hpcddp.allgather_object(steps)
    rounds = hpcddp.allgather_object(averager.num_rounds)
    assert len(set(rounds)) == 1 and rounds[0] >= 3, f"rounds applied per rank: {rounds}"  # stopped at one round
    if hpcddp.size() > 1:
        fast = all_steps[:slow]
        assert min(fast) > 2 * all_steps[slow], f"steps per rank: {all_steps} (the last rank sleeps 10x longer)"
    before = floating_state(model)
    spread = np.max(np.abs(np.stack(hpcddp.allgather_object(before)) - before))
    assert np.isfinite(before).all() and spread < 0.2 * np.max(np.abs(before)), f"spread {spread}"
    averager.close()
    after = floating_state(model)
    assert np.isfinite(after).all() and same_on_every_rank(after)


def test_warmup_averages_every_step_synchronously():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = hpcddp.AsyncModelAverager(model, optimizer, warmup_steps=3)
    for step in range(3):
        before = floating_state(model)
        local_step(model, optimizer, step)
        after = floating_state(model)
        assert same_on_every_rank(after), f"warm-up step {step} left the ranks apart"
        assert not np.array_equal(before, after)
    assert averager.num_rounds == 0
    averager.close()


def test_paused_steps_stay_local_and_other_collectives_may_run():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    train_for(model, optimizer, 0.2)
    with averager.paused():
        rounds = averager.num_rounds
        assert len(set(hpcddp.allgather_object(rounds))) == 1
        local_step(model, optimizer, 50)
        local_step(model, optimizer, 51)
        state = floating_state(model)
        assert not same_on_every_rank(state) or hpcddp.size() == 1  # no round ran while paused
        assert averager.num_rounds == rounds
        total = hpcddp.allreduce(torch.ones(1), op="sum")  # an evaluation's collective
        assert total.item() == hpcddp.size()
    train_for(model, optimizer, 0.2)
    averager.pause()
    assert averager.num_rounds > rounds or hpcddp.size() == 1
    averager.resume()
    averager.close()
    assert same_on_every_rank(floating_state(model))


def test_close_while_another_rank_still_steps():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    # Rank 0 closes after 0.2 s, the others go on stepping for 0.6 s: rank 0 waits in close().
    train_for(model, optimizer, 0.2 if hpcddp.rank() == 0 else 0.6)
    averager.close()
    assert same_on_every_rank(floating_state(model))


def test_gloo_communicator(gloo):
    from hpcddp.comm.torchdist import TorchDistCommunicator

    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = hpcddp.AsyncModelAverager(
        model, optimizer, communicator=TorchDistCommunicator("gloo", torch.device("cpu"))
    )
    assert same_on_every_rank(floating_state(model))
    train_for(model, optimizer, 0.3, slow_rank=hpcddp.size() - 1)
    averager.pause()
    assert len(set(hpcddp.allgather_object(averager.num_rounds))) == 1
    expected = mpi4py_average(floating_state(model))
    averager.close()
    closed = floating_state(model)
    assert same_on_every_rank(closed)
    np.testing.assert_allclose(closed, expected, rtol=1e-6, atol=1e-7)


def test_steps_in_another_thread_while_this_one_pauses():
    import threading

    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    local_step(model, optimizer, 0)  # gradients to step with; the worker steps only (rule 3 of the module)
    stop = threading.Event()

    def steps():
        while not stop.is_set():
            optimizer.step()
            time.sleep(FAST_PAUSE_S)

    worker = threading.Thread(target=steps)
    worker.start()
    try:
        time.sleep(0.3)
        averager.pause()  # takes the lock between two of the worker's steps
        assert len(set(hpcddp.allgather_object(averager.num_rounds))) == 1
        averager.resume()
        time.sleep(0.1)
        averager.close()  # while the worker steps: it may wait for the lock with the post-step hook gone
        time.sleep(0.05)  # its steps go on, local
    finally:
        stop.set()
        worker.join()
    averager.close()  # from this thread again: no lock is left behind
    assert np.isfinite(floating_state(model)).all()


def test_batchnorm_running_variance_stays_positive_when_ranks_see_other_scales():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    scale = 1000.0 if hpcddp.rank() == 0 else 0.01
    for step in range(60):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, generator=generator) * (scale * 50 if step == 0 else scale)  # a decaying spike
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        time.sleep(FAST_PAUSE_S)
        assert (model[1].running_var > 0).all(), f"step {step}: running_var {model[1].running_var.min()}"
    averager.close()
    assert averager.num_rounds > 0 or hpcddp.size() == 1
    assert same_on_every_rank(floating_state(model)) and (model[1].running_var > 0).all()


def test_rounds_never_meet_the_scripts_collectives_or_a_second_averagers_rounds():
    # Two same-size models (an ensemble) and an allreduce of the script's own in the loop:
    # on one shared communicator a round would pair with whichever came first on each rank.
    torch.manual_seed(0)
    zeros, thousands = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    torch.nn.init.zeros_(zeros.weight), torch.nn.init.zeros_(zeros.bias)
    torch.nn.init.constant_(thousands.weight, 1000.0), torch.nn.init.constant_(thousands.bias, 1000.0)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (zeros, thousands)]  # steps change nothing
    averagers = [hpcddp.AsyncModelAverager(m, o) for m, o in zip((zeros, thousands), optimizers)]
    rank, size = hpcddp.rank(), hpcddp.size()
    for _ in range(30):
        for model, optimizer in zip((zeros, thousands), optimizers):
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        metric = torch.full((4, 4), float(rank))  # the shape of a weight: it would pass any shape check
        assert hpcddp.allreduce(metric, op="sum").tolist() == [[float(sum(range(size)))] * 4] * 4
        time.sleep(0.003 * (rank + 1))
    for averager in averagers:
        averager.close()
    assert torch.equal(zeros.weight, torch.zeros(4, 4)) and torch.equal(zeros.bias, torch.zeros(4))
    assert torch.equal(thousands.weight, torch.full((4, 4), 1000.0))


def test_a_model_moved_after_construction_is_refused_at_the_next_round():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    model.double()  # new tensors: rounds would update the old ones, silently
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    replaced = r"the model's parameters or buffers were replaced after it was made"
    with pytest.raises(RuntimeError, match=replaced):
        averager.pause()
    with pytest.raises(RuntimeError, match=replaced):
        averager.close()


def test_a_layer_added_after_construction_is_named_as_a_change_not_a_replacement():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    model.add_module("head", torch.nn.Linear(3, 2))  # new parameters no round would reach
    changed = r"the model's parameters changed after it was made \(parameter head\.weight added, parameter head\.bias"
    with pytest.raises(RuntimeError, match=changed):
        averager.pause()
    with pytest.raises(RuntimeError, match=changed):
        averager.close()


def close_within(averager, seconds: float = 60.0) -> None:
    """``averager.close()`` from another thread, failing (not hanging) when it does not return in time."""
    import threading

    errors = []

    def close():
        try:
            averager.close()
        except BaseException as err:  # noqa: BLE001 - handed to the test below
            errors.append(err)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), f"close() still waits after {seconds} s (a failed step kept the averager's lock)"
    if errors:
        raise errors[0]


def test_a_step_that_raised_in_a_thread_leaves_no_lock_behind():
    import threading

    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    caught = []

    def broken_closure():
        raise ValueError("the loss could not be computed")

    def train():
        for step in range(20):
            local_step(model, optimizer, step)
            time.sleep(FAST_PAUSE_S)
        if hpcddp.rank() == hpcddp.size() - 1:  # the thread's last step, on one rank: no later step frees the lock
            try:
                optimizer.step(broken_closure)
            except ValueError as err:
                caught.append(err)

    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
    assert len(caught) == (1 if hpcddp.rank() == hpcddp.size() - 1 else 0)
    close_within(averager)  # from the main thread, which never stepped
    assert same_on_every_rank(floating_state(model))


def test_close_averages_the_tensors_loaded_with_assign_while_paused():
    model = rank_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = hpcddp.AsyncModelAverager(model, optimizer)
    train_for(model, optimizer, 0.2)
    averager.pause()
    torch.manual_seed(100 + hpcddp.rank())  # a checkpoint of each rank's own, loaded as new tensors
    loaded = {k: torch.randn_like(v) if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(loaded, assign=True)
    expected = mpi4py_average(floating_state(model))
    with pytest.raises(RuntimeError, match="the model's parameters or buffers were replaced after it was made"):
        averager.resume()  # the optimizer still steps the old tensors: rounds cannot go on
    averager.close()
    closed = floating_state(model)
    assert same_on_every_rank(closed), "close() must leave bitwise identical models"
    np.testing.assert_allclose(closed, expected, rtol=1e-6, atol=1e-7)
