"""hpcddp.join(): ranks with different numbers of batches finish without a hang, and the
result equals training on the union of the data, each step averaging over the ranks
that still had a batch."""

import pytest
import torch
import torch.nn.functional as F

import hpcddp

# Batches per rank; at 4 ranks one rank has none at all.
NUM_BATCHES = [3, 5, 1, 0]


def num_batches(rank):
    return NUM_BATCHES[rank % len(NUM_BATCHES)]


def rank_data(rank):
    generator = torch.Generator().manual_seed(500 + rank)
    return [
        (torch.randn(6, 5, generator=generator), torch.randint(0, 3, (6,), generator=generator))
        for _ in range(num_batches(rank))
    ]


def make_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference():
    """One process, all ranks' data: step t averages the losses of the ranks that have a batch t."""
    model = make_model()
    optimizer = make_sgd(model.parameters())
    data = [rank_data(r) for r in range(hpcddp.size())]
    for step in range(max(len(d) for d in data)):
        active = [d[step] for d in data if step < len(d)]
        optimizer.zero_grad()
        loss = sum(F.cross_entropy(model(x), y) for x, y in active) / len(active)
        loss.backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("set_to_none", [True, False])
def test_uneven_batches_match_the_union_of_the_data(set_to_none):
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(
        make_sgd(model.parameters()), model.named_parameters(), bucket_cap_mb=0.0005, first_bucket_mb=0.0002
    )
    assert len(optimizer.buckets) > 1
    with hpcddp.join(optimizer):
        for x, y in rank_data(hpcddp.rank()):
            optimizer.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    expected = reference()
    for (name, want), got in zip(expected.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # Every rank took the same steps, so every rank holds the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hpcddp.allgather_object(flat)
    for other in gathered:
        torch.testing.assert_close(other, gathered[0], atol=0, rtol=0)
    # After the block the average is over all ranks again, and all count as active.
    assert not optimizer.reducer.divide_by_active and optimizer.reducer.active_ranks == hpcddp.size()
    optimizer.close()


def test_join_with_even_batches_is_plain_training():
    # Every rank has the same batches, so the average gradient is the local one.
    data = rank_data(1)
    model, expected = make_model(), make_model()
    opt = hpcddp.DistributedOptimizer(make_sgd(model.parameters()), model.named_parameters())
    with hpcddp.join(opt):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    plain = make_sgd(expected.parameters())
    for x, y in data:
        plain.zero_grad()
        F.cross_entropy(expected(x), y).backward()
        plain.step()
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    opt.close()


def test_join_ends_with_the_last_joiners_parameters_everywhere():
    # A scheduler steps only on ranks with data: without the final copy the ranks
    # that left early would keep a different learning rate and different weights.
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(make_sgd(model.parameters()), model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with hpcddp.join(optimizer):
        for x, y in rank_data(hpcddp.rank()):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hpcddp.allgather_object(flat)
    for other in gathered:
        torch.testing.assert_close(other, gathered[0], atol=0, rtol=0)
    optimizer.close()
