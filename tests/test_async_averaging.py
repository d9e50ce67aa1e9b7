"""AsyncModelAverager in one process: bad arguments name the knob, and a world of one averages nothing.

The multi-rank behaviour is tested in tests/mpi/test_async_averaging.py.
"""

import pytest
import torch
import torch.nn.functional as F

import hpcddp

pytestmark = pytest.mark.unit


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_world_of_one_trains_as_the_plain_optimizer(world_of_one):
    model, reference = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    averager = hpcddp.AsyncModelAverager(model, optimizer, warmup_steps=1)
    for step in range(4):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            F.cross_entropy(m(x), (x.sum(1) > 0).long()).backward()
            opt.step()
        if step == 1:
            with averager.paused():
                pass
    averager.close()
    averager.close()
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match=r"resume\(\) after close\(\)"):
        averager.resume()


class NoFloats(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


def no_floats():
    model = NoFloats()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), 0


def with_complex(model):
    model.phase = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), 0


@pytest.mark.parametrize(
    "build, error, message",
    [
        (
            lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1), -1),
            ValueError,
            "warmup_steps must be an integer >= 0, got -1",
        ),
        (
            lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1), 1.5),
            ValueError,
            "warmup_steps must be an integer >= 0, got 1.5",
        ),
        (
            lambda m: (m.state_dict(), torch.optim.SGD(m.parameters(), lr=0.1), 0),
            TypeError,
            "model must be a torch.nn.Module, got",
        ),
        (lambda m: (m, "sgd", 0), TypeError, "optimizer must be a torch.optim.Optimizer, got str"),
        (
            lambda m: (m, torch.optim.SGD([*m.parameters(), torch.nn.Parameter(torch.ones(5, 2))], lr=0.1), 0),
            ValueError,
            r"optimizer holds 1 parameter\(s\) that are not model's \(the first of shape \[5, 2\]\): build the "
            r"optimizer from model.parameters\(\)",
        ),
        (lambda m: no_floats(), ValueError, "model has no floating-point parameters to average, got NoFloats"),
        (
            lambda m: with_complex(m),
            ValueError,
            r"model has complex parameters \(phase\), which AsyncModelAverager does not average: hold them as "
            r"torch.view_as_real\(\) pairs of floats",
        ),
    ],
    ids=[
        "negative-warmup",
        "float-warmup",
        "not-a-module",
        "not-an-optimizer",
        "stray-parameter",
        "no-floats",
        "complex",
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(world_of_one, build, error, message):
    with pytest.raises(error, match=message):
        hpcddp.AsyncModelAverager(*build(make_model()))


def test_a_distributed_optimizer_is_refused(world_of_one):
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    with pytest.raises(TypeError, match="got an hpcddp.DistributedOptimizer .*: pass the optimizer it wraps"):
        hpcddp.AsyncModelAverager(model, optimizer)
    optimizer.close()
