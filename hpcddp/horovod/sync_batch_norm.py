"""Horovod's SyncBatchNorm: batch statistics over the samples of every rank in a process set."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm.base import ReduceOp
from .process_sets import communicator_of, global_process_set

__all__ = ["SyncBatchNorm"]


def _channel_sums(*tensors: torch.Tensor) -> torch.Tensor:
    """Per-channel sums over every dimension but dim 1, stacked (one row per tensor)."""
    dims = [0, *range(2, tensors[0].dim())]
    return torch.stack([t.sum(dim=dims) for t in tensors])


def _per_channel(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.reshape(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, mean, invstd, count, comm):
        x = input.double()
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        out = xhat * _per_channel(weight.double(), x) + _per_channel(bias.double(), x)
        ctx.save_for_backward(xhat, invstd, weight, count)
        ctx.comm = comm
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, invstd, weight, n = ctx.saved_tensors
        g = grad_out.double()
        local = _channel_sums(g, g * xhat)
        grad_bias, grad_weight = local[0].clone(), local[1].clone()
        # The input's gradient needs the sums over every rank's samples.
        ctx.comm.allreduce_async_(local, ReduceOp.SUM, check="sync_batch_norm.grad").wait()
        sum_g, sum_gx = local[0] / n, local[1] / n
        grad_input = (g - _per_channel(sum_g, g) - xhat * _per_channel(sum_gx, g)) * _per_channel(
            invstd * weight.double(), g
        )
        grads = grad_input.to(grad_out.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)
        return (*grads, None, None, None, None)


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training statistics cover the batches of every rank (Horovod's).

    Arguments as ``torch.nn.BatchNorm*d``; ``process_set`` picks the ranks whose batches
    are pooled. In eval mode (or with ``track_running_stats`` and no training) it is a
    plain batch norm with the running statistics, which match on every rank.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of 2 or more dimensions, got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        comm = communicator_of(self.process_set)
        if not self.training or comm.size == 1:
            return super().forward(input)
        with torch.no_grad():
            x = input.double()
            count = torch.full((1, x.shape[1]), x.numel() / x.shape[1], dtype=torch.float64, device=x.device)
            totals = torch.cat([_channel_sums(x, x * x), count])
            comm.allreduce_async_(totals, ReduceOp.SUM, check="sync_batch_norm").wait()
            n = totals[2]
            mean = totals[0] / n
            var = (totals[1] / n - mean * mean).clamp_min(0)
            if self.track_running_stats:
                self._update_running_stats(mean, var * n / (n - 1).clamp_min(1))
        weight = self.weight if self.affine else torch.ones(self.num_features, device=input.device)
        bias = self.bias if self.affine else torch.zeros(self.num_features, device=input.device)
        return _SyncBatchNormFunction.apply(input, weight, bias, mean, torch.rsqrt(var + self.eps), n, comm)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked += 1
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased_var.to(self.running_var.dtype), alpha=momentum)
