"""Parameter averaging: local steps, then every rank's parameters replaced by their average.

    averager = hpcddp.PeriodicModelAverager(period=4, warmup_steps=100)
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()              # a plain torch optimizer once warm-up is over
        loss_fn(model(x), y).backward()
        optimizer.step()
        averager.average_parameters(model.parameters())

The semantics are those of torch's
``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``, on
hpcddp's communicator (MPI, gloo or nccl) instead of a torch.distributed group.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from ..comm.base import Communicator, ReduceOp

__all__ = ["PeriodicModelAverager", "check_count", "job_communicator"]


class PeriodicModelAverager:
    """Average parameters over all ranks every ``period`` calls, once ``warmup_steps`` calls have passed.

    Each ``average_parameters`` call is one step: the parameters are averaged in
    steps ``warmup_steps``, ``warmup_steps + period``, ... (counting from 0). Used
    for post-local SGD: a synchronous DistributedOptimizer for the first
    ``warmup_steps`` steps, then a local optimizer whose ranks drift apart for
    ``period - 1`` steps between averages.

    Args:
        period: steps between averages (>= 1; 1 costs more than averaging gradients).
        warmup_steps: steps before the first average (>= 0).
        communicator: the Communicator to use; the one ``hpcddp.init()`` made by default.
    """

    def __init__(self, period: int, warmup_steps: int = 0, *, communicator: Communicator | None = None) -> None:
        check_count("period", period, 1)
        check_count("warmup_steps", warmup_steps, 0)
        if period == 1:
            warnings.warn(
                "PeriodicModelAverager(period=1) averages the parameters at every step, which costs as much "
                "communication as averaging the gradients: use hpcddp.DistributedOptimizer instead",
                stacklevel=2,
            )
        self.period = period
        self.warmup_steps = warmup_steps
        #: calls of ``average_parameters`` so far
        self.step = 0
        self._comm = job_communicator(communicator)

    def average_parameters(self, params: Iterable[torch.Tensor] | Iterable[dict]) -> None:
        """Count a step and, when it is due, replace ``params`` by their average over all ranks.

        Only parameters that have a gradient are averaged, as torch's averager does.
        Collective in the steps that average: every rank calls it equally often.

        Args:
            params: ``model.parameters()``, or an optimizer's ``param_groups``.
        """
        due = self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0
        if due:
            _average(_with_gradients(params), self._comm)
        self.step += 1


def check_count(name: str, value: object, least: int) -> None:
    """Raise ValueError unless ``value`` is an integer >= ``least`` (a bool is not a count).

    Args:
        name: the argument, for the message.
        value: what the caller passed.
        least: the smallest value allowed.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def job_communicator(communicator: Communicator | None) -> Communicator:
    """Return ``communicator``, or the one ``hpcddp.init()`` made when it is None."""
    if communicator is not None:
        return communicator
    from ..runtime.state import communicator as current

    return current()


def _with_gradients(params: Iterable[torch.Tensor] | Iterable[dict]) -> list[torch.Tensor]:
    """The parameters (from tensors or param groups) that have a gradient."""
    chosen = []
    for item in params:
        if isinstance(item, dict):
            chosen.extend(p for p in item["params"] if p.grad is not None)
        elif isinstance(item, torch.Tensor):
            if item.grad is not None:
                chosen.append(item)
        else:
            raise TypeError(f"params must hold tensors or param-group dicts, got {type(item).__name__}")
    return chosen


@torch.no_grad()
def _average(params: list[torch.Tensor], comm: Communicator) -> None:
    """Replace every tensor in ``params`` by its average over all ranks, in one allreduce.

    As torch's: the tensors are packed into one flat buffer (mixed dtypes promoted),
    divided by the world size, summed, and copied back in their own dtypes.

    Args:
        params: the tensors to average (the same list on every rank).
        comm: the communicator.
    """
    if comm.size == 1 or not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat.div_(comm.size)
    comm.allreduce_(flat, ReduceOp.SUM)
    offset = 0
    for param in params:
        param.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
