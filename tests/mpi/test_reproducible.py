"""reproducible=True on every rank: uneven spreads, a rank without micro-batches, and errors raised everywhere."""

from fractions import Fraction

import pytest
import torch

import hpcddp


def model_and_optimizer(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), reproducible=True, **kwargs
    )
    return model, optimizer


def micro_batch(index):
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randn(3, 4, generator=generator) * 10.0 ** (index % 5 - 2)  # gradients of several magnitudes


def exact_mean_grads(model, indices):
    """Each micro-batch's gradient computed here, then their mean as exact fractions, rounded once."""
    grads = []
    for index in indices:
        grads.append(torch.autograd.grad(model(micro_batch(index)).square().sum(), list(model.parameters())))
    means = []
    for position, param in enumerate(model.parameters()):
        flat = [g[position].double().reshape(-1).tolist() for g in grads]
        mean = [float(sum(Fraction(values[i]) for values in flat) / len(flat)) for i in range(param.numel())]
        means.append(torch.tensor(mean, dtype=torch.float64).view_as(param).to(param.dtype))
    return means


@pytest.mark.parametrize("total", [8, 1, 0])
def test_uneven_spreads_and_ranks_without_micro_batches_give_the_exact_mean(total):
    model, optimizer = model_and_optimizer()
    rank, size = hpcddp.rank(), hpcddp.size()
    mine = [i for i in range(total) if i % size == rank][::-1]  # interleaved, and in reverse on this rank
    for index in mine:
        model(micro_batch(index)).square().sum().backward()
    optimizer.synchronize()
    if total == 0:
        assert all(p.grad is None for p in model.parameters())
    else:
        for param, want in zip(model.parameters(), exact_mean_grads(model, range(total))):
            assert torch.equal(param.grad, want) or (param.grad - want).abs().max() <= 1e-6 * want.abs().max()
    gathered = hpcddp.allgather_object([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    for other in gathered[1:]:
        for a, b in zip(gathered[0], other):
            assert (a is None and b is None) or torch.equal(a, b)
    optimizer.step()


def test_a_non_finite_gradient_on_one_rank_is_an_error_on_every_rank():
    model, optimizer = model_and_optimizer()
    x = micro_batch(hpcddp.rank())
    if hpcddp.rank() == hpcddp.size() - 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()
    with pytest.raises(FloatingPointError, match="'0.weight'"):
        optimizer.step()
    model(micro_batch(0)).sum().backward()
    optimizer.step()  # the next step works on every rank
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_nonfinite_skips_on_every_rank():
    model, optimizer = model_and_optimizer(skip_nonfinite=True)
    before = [p.detach().clone() for p in model.parameters()]
    x = micro_batch(hpcddp.rank())
    if hpcddp.rank() == 0:
        x[0, 0] = float("inf")
    model(x).sum().backward()
    optimizer.step()
    assert optimizer.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_gradient_assigned_by_hand_on_one_rank_is_an_error_on_every_rank():
    model, optimizer = model_and_optimizer()
    model(micro_batch(hpcddp.rank())).sum().backward()
    if hpcddp.rank() == 1:
        model[2].bias.grad = torch.ones_like(model[2].bias)
    with pytest.raises(RuntimeError, match="'2.bias'.*assigned by hand"):
        optimizer.step()


def test_a_backward_pass_that_raised_on_one_rank_stops_the_step_on_every_rank():
    model, optimizer = model_and_optimizer()

    class FailOnLastRank(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if hpcddp.rank() == hpcddp.size() - 1:
                raise ValueError("boom")
            return grad

    try:
        model[2](FailOnLastRank.apply(model[1](model[0](micro_batch(0))))).sum().backward()
    except ValueError:
        assert hpcddp.rank() == hpcddp.size() - 1
    with pytest.raises(hpcddp.StepStoppedError, match=f"rank {hpcddp.size() - 1}"):
        optimizer.step()
    model(micro_batch(1)).sum().backward()
    optimizer.step()


def test_different_models_on_the_ranks_are_an_error_on_every_rank():
    width = 6 + (hpcddp.rank() == 1)
    model = torch.nn.Linear(4, width)
    with pytest.raises(ValueError, match="weight"):
        hpcddp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), reproducible=True
        )


def test_the_int64_sum_across_ranks_gives_the_same_bits_as_the_float64_one(monkeypatch):
    from hpcddp.reproducible import fixed_point

    results = []
    for limit in (fixed_point.MAX_LOCAL_CONTRIBUTIONS, 1):  # 1: past it at once (one pass per rank, >= 2 ranks)
        monkeypatch.setattr(fixed_point, "MAX_LOCAL_CONTRIBUTIONS", limit)
        model, optimizer = model_and_optimizer()
        model(micro_batch(hpcddp.rank())).square().sum().backward()
        optimizer.synchronize()
        results.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(*results))
    for param, want in zip(results[1], exact_mean_grads(model_and_optimizer()[0], range(hpcddp.size()))):
        assert (param - want).abs().max() <= 1e-6 * want.abs().max()


def test_a_rank_idle_in_one_step_adds_nothing_stale_to_the_next():
    model, optimizer = model_and_optimizer()
    optimizer.param_groups[0]["lr"] = 0.0  # the gradients alone are compared
    for step, total in enumerate((1, 2, 1, 3)):  # fewer micro-batches than ranks: some ranks idle
        first = 10 * step
        for index in range(first, first + total):
            if index % hpcddp.size() == hpcddp.rank():
                model(micro_batch(index)).square().sum().backward()
        optimizer.synchronize()
        for param, want in zip(model.parameters(), exact_mean_grads(model, range(first, first + total))):
            assert (param.grad - want).abs().max() <= 1e-6 * want.abs().max(), step
        optimizer.step()
        optimizer.zero_grad()
