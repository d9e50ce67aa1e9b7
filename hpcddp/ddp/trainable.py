"""Parameters that were frozen when the buckets were built: notice their first gradient, average it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm.base import Communicator, ReduceOp

__all__ = ["average_loose_grads", "require_trainable", "watch_frozen"]


def require_trainable(named: Sequence[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """Return the (name, parameter) pairs that require grad; raise when there are none.

    Args:
        named: the optimizer's (name, parameter) pairs.
    """
    trainable = [(name, p) for name, p in named if p.requires_grad]
    if not trainable:
        # Unfreezing is noticed through the buckets' control numbers: some must exist.
        raise ValueError(
            f"none of the {len(named)} parameters requires grad: set requires_grad=True on those "
            "to train before building the DistributedOptimizer"
        )
    return trainable


def watch_frozen(param: torch.nn.Parameter, callback: Callable[[torch.nn.Parameter], None]) -> Any:
    """Call ``callback(param)`` whenever the frozen ``param`` receives a gradient; return the hook handle.

    It receives one only once the user sets ``requires_grad=True`` on it.
    """
    # torch only hooks tensors that require grad; the hook stays when it is switched off again.
    param.requires_grad_(True)
    try:
        return param.register_post_accumulate_grad_hook(callback)
    finally:
        param.requires_grad_(False)


def average_loose_grads(params: list[torch.nn.Parameter], comm: Communicator, op: ReduceOp, zero_unused: bool) -> None:
    """Reduce the gradients of ``params`` (in no bucket) with one allreduce per device and dtype.

    Collective. A parameter that no rank gave a gradient keeps ``grad`` None (zeros
    with ``zero_unused``), as in the buckets.

    Args:
        params: the same parameters, in the same order, on every rank.
        comm: the communicator.
        op: ``ReduceOp.AVERAGE`` or ``ReduceOp.SUM``.
        zero_unused: give unused parameters zero gradients instead of None.
    """
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault((param.device, param.dtype), []).append(param)
    for members in groups.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in members]
        used = torch.tensor([p.grad is not None for p in members], dtype=members[0].dtype, device=members[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [used])
        comm.allreduce_(flat, ReduceOp.SUM)
        if op is ReduceOp.AVERAGE:
            flat[: flat.numel() - len(members)].div_(comm.size)
        offset = 0
        for param in members:
            param.grad = flat[offset : offset + param.numel()].view_as(param).clone()
            offset += param.numel()
        for param, count in zip(members, flat[offset:].tolist()):
            if count == 0 and not zero_unused:
                param.grad = None
