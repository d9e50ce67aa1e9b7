"""Collectives on torch tensors over the backend chosen by ``hpcddp.init``."""

from __future__ import annotations

from typing import Any

import torch

from ..comm.base import Handle, ReduceOp, parse_op
from ..runtime.state import communicator

# Every collective here is checked first: the ranks compare shapes, dtypes, roots and
# ops (one small message) and raise CollectiveMismatchError alike when they differ
# (hpcddp.comm.agreement). "" is the check's tensor name: these functions take none.
_CHECK = ""

__all__ = [
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "reducescatter",
    "reducescatter_async",
]


def allreduce_async_(tensor: torch.Tensor, op: str | ReduceOp = "average") -> Handle:
    """Start reducing ``tensor`` in place across ranks; ``wait()`` returns it.

    Args:
        tensor: the tensor to reduce; every rank passes one of the same shape and dtype
            (else every rank raises CollectiveMismatchError).
        op: "average" (default), "sum", "min", "max" or "product".
    """
    reduce_op = _check_op(tensor, op)
    # detach(): the same storage, so a parameter (a leaf that requires grad) can be
    # reduced in place too; the caller gets its own tensor back.
    return communicator().allreduce_async_(tensor.detach(), reduce_op, check=_CHECK).then(lambda _: tensor)


def allreduce_async(tensor: torch.Tensor, op: str | ReduceOp = "average") -> Handle:
    """Start reducing a copy of ``tensor``; ``wait()`` returns the reduced copy.

    Args:
        tensor: the tensor to reduce; it is left unchanged.
        op: "average" (default), "sum", "min", "max" or "product".
    """
    return allreduce_async_(tensor.detach().clone(), op)


def allreduce_(tensor: torch.Tensor, op: str | ReduceOp = "average") -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it.

    Args:
        tensor: the tensor to reduce.
        op: "average" (default), "sum", "min", "max" or "product".
    """
    # detach() only where needed: this is the latency path of small allreduces.
    communicator().allreduce_(tensor.detach() if tensor.requires_grad else tensor, _check_op(tensor, op), check=_CHECK)
    return tensor


def allreduce(tensor: torch.Tensor, op: str | ReduceOp = "average") -> torch.Tensor:
    """Return the reduction of ``tensor`` across ranks, leaving ``tensor`` unchanged.

    Args:
        tensor: the tensor to reduce.
        op: "average" (default), "sum", "min", "max" or "product".
    """
    return communicator().allreduce(tensor.detach(), _check_op(tensor, op), check=_CHECK)


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0) -> Handle:
    """Start overwriting ``tensor`` with root's on every rank.

    Args:
        tensor: root's source, every other rank's destination.
        root_rank: the rank whose tensor is sent.
    """
    _check_root(root_rank)
    return communicator().broadcast_async_(tensor.detach(), root_rank, check=_CHECK).then(lambda _: tensor)


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
    return communicator().allgather_async(tensor, check=_CHECK)


def allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Return every rank's ``tensor`` concatenated along dim 0, in rank order."""
    return allgather_async(tensor).wait()


def reducescatter_async(
    tensor: torch.Tensor, op: str | ReduceOp = "average", splits: list[int] | None = None
) -> Handle:
    """Start reducing ``tensor`` across ranks and keeping this rank's rows; ``wait()`` returns them.

    Args:
        tensor: the same shape and dtype on every rank; it is left unchanged.
        op: "average" (default), "sum", "min", "max" or "product".
        splits: rows of the result for each rank, the same list on every rank; None
            splits evenly, the first ``rows % size`` ranks getting one more row.
    """
    return communicator().reducescatter_async(tensor.detach(), _check_op(tensor, op), splits, check=_CHECK)


def reducescatter(
    tensor: torch.Tensor, op: str | ReduceOp = "average", splits: list[int] | None = None
) -> torch.Tensor:
    """Return this rank's rows of the reduction of ``tensor`` across ranks (see ``reducescatter_async``)."""
    return reducescatter_async(tensor, op, splits).wait()


def alltoall_async(tensor: torch.Tensor, splits: list[int] | None = None) -> Handle:
    """Start sending ``splits[r]`` rows of ``tensor`` to each rank r; ``wait()`` returns
    ``(received rows in rank order, received splits as an int64 tensor)``.

    Args:
        tensor: the rows to distribute; dimensions after the first agree across ranks.
        splits: rows for each rank, summing to ``tensor.shape[0]``; None splits
            evenly (the first dimension must then be divisible by ``size()``).
    """
    return communicator().alltoall_async(tensor.detach(), splits, check=_CHECK)


def alltoall(tensor: torch.Tensor, splits: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the rows every rank sent this rank and how many came from each (see ``alltoall_async``)."""
    return alltoall_async(tensor, splits).wait()


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
