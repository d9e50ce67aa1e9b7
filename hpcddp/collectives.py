"""Collectives on torch tensors over the backend chosen by ``hpcddp.init``."""

from __future__ import annotations

from typing import Any

import torch

from .bootstrap import communicator
from .comm.base import Handle, ReduceOp, parse_op

__all__ = [
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
]


def allreduce_async_(tensor: torch.Tensor, op: str | ReduceOp = "average") -> Handle:
    """Start reducing ``tensor`` in place across ranks; ``wait()`` returns it.

    Args:
        tensor: the tensor to reduce; every rank passes one of the same shape and dtype.
        op: "average" (default), "sum", "min" or "max".
    """
    reduce_op = _check_op(tensor, op)
    # detach(): the same storage, so a parameter (a leaf that requires grad) can be
    # reduced in place too; the caller gets its own tensor back.
    return communicator().allreduce_async_(tensor.detach(), reduce_op).then(lambda _: tensor)


def allreduce_async(tensor: torch.Tensor, op: str | ReduceOp = "average") -> Handle:
    """Start reducing a copy of ``tensor``; ``wait()`` returns the reduced copy.

    Args:
        tensor: the tensor to reduce; it is left unchanged.
        op: "average" (default), "sum", "min" or "max".
    """
    return allreduce_async_(tensor.detach().clone(), op)


def allreduce_(tensor: torch.Tensor, op: str | ReduceOp = "average") -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it.

    Args:
        tensor: the tensor to reduce.
        op: "average" (default), "sum", "min" or "max".
    """
    # detach() only where needed: this is the latency path of small allreduces.
    communicator().allreduce_(tensor.detach() if tensor.requires_grad else tensor, _check_op(tensor, op))
    return tensor


def allreduce(tensor: torch.Tensor, op: str | ReduceOp = "average") -> torch.Tensor:
    """Return the reduction of ``tensor`` across ranks, leaving ``tensor`` unchanged.

    Args:
        tensor: the tensor to reduce.
        op: "average" (default), "sum", "min" or "max".
    """
    return communicator().allreduce(tensor.detach(), _check_op(tensor, op))


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0) -> Handle:
    """Start overwriting ``tensor`` with root's on every rank.

    Args:
        tensor: root's source, every other rank's destination.
        root_rank: the rank whose tensor is sent.
    """
    _check_root(root_rank)
    return communicator().broadcast_async_(tensor.detach(), root_rank).then(lambda _: tensor)


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0) -> Handle:
    """Start broadcasting into a copy of ``tensor``; ``wait()`` returns root's values."""
    return broadcast_async_(tensor.detach().clone(), root_rank)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with root's on every rank and return it."""
    return broadcast_async_(tensor, root_rank).wait()


def broadcast(tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
    """Return root's ``tensor`` on every rank, leaving the argument unchanged."""
    return broadcast_async(tensor, root_rank).wait()


def allgather_async(tensor: torch.Tensor) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    return communicator().allgather_async(tensor)


def allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Return every rank's ``tensor`` concatenated along dim 0, in rank order."""
    return allgather_async(tensor).wait()


def broadcast_object(obj: Any = None, root_rank: int = 0) -> Any:
    """Return root's picklable ``obj`` on every rank."""
    _check_root(root_rank)
    return communicator().broadcast_object(obj, root_rank)


def allgather_object(obj: Any) -> list[Any]:
    """Return every rank's picklable ``obj`` as a list in rank order."""
    return communicator().allgather_object(obj)


def barrier() -> None:
    """Block until every rank has reached this barrier."""
    communicator().barrier()


_OPS_BY_NAME = {op.value: op for op in ReduceOp}


def _check_op(tensor: torch.Tensor, op: str | ReduceOp) -> ReduceOp:
    reduce_op = op if op.__class__ is ReduceOp else _OPS_BY_NAME.get(op) or parse_op(op)
    if reduce_op is ReduceOp.AVERAGE and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        raise TypeError(f"op='average' needs a floating-point tensor, got {tensor.dtype}: use op='sum'")
    return reduce_op


def _check_root(root_rank: int) -> None:
    size = communicator().size
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be in [0, {size}), got {root_rank}")
