"""Communication runs during backward where the rank has a core to spare, after it on a CPU rank bound to one core."""

import os
import time

import torch

import hpcddp


class SlowFirstLayer(torch.autograd.Function):
    """Identity whose backward takes a while: the first layer's gradient comes last."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.2)
        return grad


def test_first_bucket_starts_before_backward_ends():
    torch.manual_seed(0)
    first = torch.nn.Linear(64, 64)
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    params = list(first.named_parameters(prefix="first")) + list(layers.named_parameters(prefix="layers"))
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD([p for _, p in params], lr=0.1), params, bucket_cap_mb=0.02, first_bucket_mb=0.02
    )
    assert len(optimizer.buckets) >= 3
    x = torch.randn(8, 64)
    # The first pass learns how often each parameter accumulates and reduces at its end.
    layers(first(x)).sum().backward()
    optimizer.step()
    # Backward: the later layers' gradients, then 0.2 s in the slow identity, then `first`'s.
    loss = layers(SlowFirstLayer.apply(first(x))).sum()
    loss.backward()
    optimizer.step()
    times = optimizer.times
    assert times.bucket_launch[-1] > times.bucket_launch[0] + 0.15, times
    if len(os.sched_getaffinity(0)) > 1:
        # The later layers' buckets were reduced (not only queued) while backward was
        # still inside the slow layer, before the bucket holding `first` could launch.
        assert times.bucket_done[0] < times.bucket_launch[-1] - 0.1, times
        assert times.bucket_done[0] < times.backward_end - 0.1, times
    else:
        # A CPU rank bound to one core: a communication thread could only take the core from
        # backward, so the buckets are summed once backward ended, by the training thread.
        assert times.bucket_done[0] >= times.backward_end, times
    optimizer.close()
