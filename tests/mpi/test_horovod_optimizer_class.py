"""hvd.DistributedOptimizer returns a new instance of a subclass of the user's optimizer class, as Horovod does."""

import torch

import hpcddp.horovod as hvd


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def batch(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 3, generator=generator, dtype=torch.float64)


def loss_of(model, x):
    return (model(x) - 1.0).pow(2).mean()


def test_the_wrapper_is_an_instance_of_the_users_class_with_fresh_state():
    model = make_model()
    base = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    loss_of(model, batch(hvd.rank(), 0)).backward()
    base.step()
    assert len(base.state) == 4
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(optimizer, torch.optim.Adam) and isinstance(optimizer, torch.optim.Optimizer)
    assert type(optimizer) is not torch.optim.Adam and type(optimizer).__name__ == "Adam"
    assert optimizer is not base and len(optimizer.state) == 0 and optimizer.state_dict()["state"] == {}
    # The groups are shared: options set on either are seen by both, as with Horovod.
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    base.param_groups[0]["lr"] = 0.5
    assert optimizer.param_groups[0]["lr"] == 0.5
    optimizer.close()


def adam_reference(steps):
    """One process, plain torch: Adam with fresh state on the mean of the ranks' gradients."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        (sum(loss_of(model, batch(r, step)) for r in range(hvd.size())) / hvd.size()).backward()
        optimizer.step()
    return model


def test_state_broadcast_before_wrapping_is_not_carried_as_in_horovod():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # a zero-gradient step: Adam's step becomes 1
    assert optimizer.state_dict()["state"][0]["step"] == 1
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for step in range(3):
        optimizer.zero_grad()
        loss_of(model, batch(hvd.rank(), step)).backward()
        optimizer.step()
    assert optimizer.state_dict()["state"][0]["step"] == 3
    for a, b in zip(model.parameters(), adam_reference(3).parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)
    optimizer.close()


def test_a_dropped_optimizer_is_freed_and_join_does_not_shadow_it():
    import gc
    import weakref

    for op in (hvd.Average, hvd.Adasum) if hvd.size() & (hvd.size() - 1) == 0 else (hvd.Average,):
        model = make_model()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), op=op
        )
        loss_of(model, batch(hvd.rank(), 0)).backward()
        optimizer.step()
        dropped = weakref.ref(optimizer)
        del optimizer
        gc.collect()
        assert dropped() is None  # the model (and its parameters' hooks) outlive it
    # Without a live optimizer join() stands in for the others' allreduces with zeros (Horovod's rule).
    if hvd.rank() == 0:
        assert hvd.join() in range(hvd.size())
    else:
        total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.join")
        assert total.tolist() == [hvd.size() - 1.0] * 2
        assert hvd.join() in range(hvd.size())
