"""PeriodicModelAverager: the same parameters as averaging with plain mpi4py, and torch's semantics."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager as TorchAverager

import hpcddp

STEPS, PERIOD, WARMUP = 9, 3, 2


def rank_model():
    torch.manual_seed(40 + hpcddp.rank())  # the ranks start apart, as after local steps
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def local_step(model, optimizer, step):
    generator = torch.Generator().manual_seed(1000 * hpcddp.rank() + step)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def mpi4py_average(params):
    from mpi4py import MPI

    flat = torch.cat([p.detach().reshape(-1) for p in params]) / hpcddp.size()
    array = flat.numpy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(torch.from_numpy(array[offset : offset + p.numel()]).view_as(p))
            offset += p.numel()


def test_periodic_averaging_equals_plain_mpi4py_averaging():
    model = rank_model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    averager = hpcddp.PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP)
    for step in range(STEPS):
        local_step(model, optimizer, step)
        averager.average_parameters(model.parameters())
        local_step(reference, reference_optimizer, step)
        due = step >= WARMUP and (step - WARMUP) % PERIOD == 0
        if due:
            mpi4py_average(list(reference.parameters()))
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        same = all(np.array_equal(other, flat) for other in hpcddp.allgather_object(flat))
        assert same == due or hpcddp.size() == 1, f"step {step}: ranks equal {same}, averaged {due}"
    assert averager.step == STEPS


def test_param_groups_and_parameters_without_gradient_as_torchs_averager(gloo):
    # torch's averager averages only parameters that have a gradient; here one layer never gets one.
    models = [rank_model(), rank_model()]
    averagers = [hpcddp.PeriodicModelAverager(period=2, warmup_steps=1), TorchAverager(period=2, warmup_steps=1)]
    for model, averager in zip(models, averagers):
        optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
        optimizer.add_param_group({"params": model[0].parameters(), "lr": 0.0})
        model[0].requires_grad_(False)  # no gradient: left alone by both averagers
        for step in range(5):
            local_step(model, optimizer, step)
            averager.average_parameters(optimizer.param_groups)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    first_layer = hpcddp.allgather_object(models[0][0].weight.detach())
    assert not torch.equal(first_layer[0], first_layer[-1])  # never averaged


@pytest.mark.parametrize(
    "kwargs, message",
    [({"period": 0}, "period must be an integer >= 1, got 0"), ({"period": 2, "warmup_steps": -1}, "warmup_steps")],
)
def test_bad_arguments_name_the_knob(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hpcddp.PeriodicModelAverager(**kwargs)
    with pytest.warns(UserWarning, match="period=1"):
        hpcddp.PeriodicModelAverager(period=1)
