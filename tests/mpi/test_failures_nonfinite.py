"""skip_nonfinite: an inf/NaN gradient on one rank skips that step on every rank, counted."""

import pytest
import torch
import torch.nn.functional as F

import hpcddp

STEPS, BAD_STEP = 4, 1


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(skip_nonfinite, compression=None):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=compression,
        skip_nonfinite=skip_nonfinite,
    )
    generator = torch.Generator().manual_seed(hpcddp.rank())
    history = [flat(model)]
    optimizer.ranks_named = []  # the non-finite ranks each reduction named
    for step in range(STEPS):
        x, y = torch.randn(4, 5, generator=generator), torch.randint(0, 2, (4,), generator=generator)
        if step == BAD_STEP and hpcddp.rank() == hpcddp.size() - 1:
            x[0, 0] = float("inf")  # only the last rank's gradient is non-finite
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.ranks_named.append(list(optimizer.reducer.nonfinite_ranks))
        optimizer.step()
        history.append(flat(model))
    optimizer.close()
    return optimizer, history


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_the_rank_whose_gradient_is_not_finite_is_named_on_every_rank(compression):
    # fp16/bf16 buckets travel in a copy: the rank's flag must reach that copy too.
    optimizer, _ = train(skip_nonfinite=True, compression=compression)
    expected = [[hpcddp.size() - 1] if step == BAD_STEP else [] for step in range(STEPS)]
    assert optimizer.ranks_named == expected


def test_nonfinite_step_is_skipped_on_every_rank():
    # With PowerSGD and int8 the bad step also leaves no inf or NaN in their error feedback.
    for compression in (None, "bf16", hpcddp.PowerSGD(start_powerSGD_iter=0), "int8"):
        optimizer, history = train(skip_nonfinite=True, compression=compression)
        assert optimizer.skipped_steps == 1
        torch.testing.assert_close(history[BAD_STEP + 1], history[BAD_STEP], atol=0, rtol=0)
        for step in range(STEPS):
            if step != BAD_STEP:
                assert not torch.equal(history[step + 1], history[step]), f"step {step} changed nothing"
        assert bool(history[-1].isfinite().all())
        assert all(
            p.grad is None or bool(p.grad.isfinite().all()) for group in optimizer.param_groups for p in group["params"]
        )
        finals = hpcddp.allgather_object(history[-1])
        assert all(torch.equal(f, finals[0]) for f in finals)
        assert hpcddp.allgather_object(optimizer.skipped_steps) == [1] * hpcddp.size()


@pytest.mark.parametrize("compression", [None, hpcddp.PowerSGD(start_powerSGD_iter=0), "int8"])
def test_without_the_option_the_nan_reaches_every_rank(compression):
    # Compression must not turn an inf or NaN into finite numbers (int8: a non-finite scale).
    optimizer, history = train(skip_nonfinite=False, compression=compression)
    assert optimizer.skipped_steps == 0
    assert not bool(history[-1].isfinite().all())


@pytest.mark.parametrize("compression", [hpcddp.PowerSGD(start_powerSGD_iter=0), "int8"], ids=["powersgd", "int8"])
@pytest.mark.parametrize("bad", ["one-inf-element", "finite-overflow"])
def test_a_non_finite_reduction_leaves_no_trace_in_the_compression_memory(compression, bad):
    # One inf where the local probe does not look (the reduction itself must notice), or finite
    # gradients so large that compressing them may overflow: at most that step is skipped, and
    # the next ones, with ordinary gradients, are not (the memory starts afresh on every rank).
    weight = torch.nn.Parameter(torch.zeros(64, 64))
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD([weight], lr=0.1), [("w", weight)], compression=compression, skip_nonfinite=True
    )
    for step in range(5):
        optimizer.zero_grad()
        grad = 0.01 + 0.001 * torch.arange(4096.0).view(64, 64) / 4096
        if step == 1 and bad == "one-inf-element" and hpcddp.rank() == hpcddp.size() - 1:
            grad.view(-1)[1] = float("inf")  # the probe reads every 4th element of this bucket
        if step == 1 and bad == "finite-overflow":
            grad = grad * 1e38
        (weight * grad).sum().backward()
        optimizer.step()
        if step == 1:
            skipped_at_the_bad_step = optimizer.skipped_steps
    optimizer.close()
    assert optimizer.skipped_steps == skipped_at_the_bad_step
    assert optimizer.skipped_steps == 1 if bad == "one-inf-element" else optimizer.skipped_steps <= 1
    assert bool(weight.isfinite().all())
