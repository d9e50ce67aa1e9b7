"""skip_nonfinite in a world of one (no buckets: the gradients themselves are checked)."""

import pytest
import torch

import hpcddp
from hpcddp.comm.local import LocalCommunicator

pytestmark = pytest.mark.unit


def test_world_of_one_skips_nonfinite_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        communicator=LocalCommunicator(),
        skip_nonfinite=True,
    )
    for scale in (1.0, float("nan"), 1.0, float("inf")):
        before = model.weight.detach().clone()
        optimizer.zero_grad()
        (model(torch.ones(2, 3)).sum() * scale).backward()
        optimizer.step()
        changed = not torch.equal(model.weight, before)
        assert changed == (scale == 1.0)
    assert optimizer.skipped_steps == 2
    assert bool(model.weight.isfinite().all())
