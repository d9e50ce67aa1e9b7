"""Horovod's collectives: allreduce, allgather and broadcast (differentiable, as Horovod's), objects, handles."""

from __future__ import annotations

from typing import Any

import torch

from .. import bootstrap, collectives
from ..broadcast import broadcast_optimizer_state as _broadcast_optimizer_state
from ..broadcast import broadcast_parameters as _broadcast_parameters
from ..comm.base import Handle, ReduceOp, parse_op
from ..stall import collective_tag
from .basics import Adasum, Average, Sum, check_process_set, global_process_set
from .compression import Compression

__all__ = [
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "poll", "synchronize",
]  # fmt: skip


def resolve_op(op, average=None) -> ReduceOp:
    """Return the ReduceOp for Horovod's ``op`` and deprecated ``average`` arguments."""
    if average is not None:
        if op is not None:
            raise ValueError(f"give op= or the deprecated average=, not both: got op={op!r}, average={average!r}")
        return Average if average else Sum
    if op is Adasum:
        raise NotImplementedError("op=hvd.Adasum is not supported by hpcddp: use hvd.Average")
    return Average if op is None else parse_op(op)


def _allreduce_handle(tensor, op: ReduceOp, name, compression, prescale_factor, postscale_factor, in_place) -> Handle:
    # detach(): in place on a parameter (a leaf that requires grad) writes its data, as Horovod does.
    source = tensor.detach() if in_place else tensor.detach().clone()
    if prescale_factor != 1.0:
        source.mul_(prescale_factor)
    # Horovod divides an integer average in place, rounding down; MPI sums, we divide after.
    integer_average = op is Average and not source.dtype.is_floating_point
    wire, ctx = compression.compress(source)
    with collective_tag(name or ""):
        handle = collectives.allreduce_async_(wire, Sum if integer_average else op)

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = compression.decompress(out, ctx)
        if integer_average:
            out.floor_divide_(bootstrap.size())
        if postscale_factor != 1.0:
            out.mul_(postscale_factor)
        if out is not source:
            source.copy_(out)
        return tensor if in_place else source

    return handle.then(finish)


class _Allreduce(torch.autograd.Function):
    """Allreduce whose gradient is the same allreduce of the incoming gradient (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor):
        ctx.args = (op, prescale_factor, postscale_factor)
        return _allreduce_handle(tensor, op, name, Compression.none, prescale_factor, postscale_factor, False).wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale = ctx.args
        reduced = _allreduce_handle(grad, op, None, Compression.none, prescale, postscale, False).wait()
        return reduced, None, None, None, None


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing a copy of ``tensor`` (Average by default); ``synchronize`` returns it."""
    check_process_set(process_set)
    return _allreduce_handle(
        tensor, resolve_op(op, average), name, Compression.none, prescale_factor, postscale_factor, False
    )


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Return the reduction of ``tensor`` across ranks (Average by default), leaving it unchanged.

    Differentiable: the gradient is the same allreduce of the incoming gradient.
    """
    check_process_set(process_set)
    reduce_op = resolve_op(op, average)
    if tensor.requires_grad and torch.is_grad_enabled():
        wire, ctx = compression.compress(tensor)
        reduced = _Allreduce.apply(wire, reduce_op, name, prescale_factor, postscale_factor)
        return compression.decompress(reduced, ctx)
    return _allreduce_handle(tensor, reduce_op, name, compression, prescale_factor, postscale_factor, False).wait()


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing ``tensor`` in place; ``synchronize`` returns it."""
    check_process_set(process_set)
    return _allreduce_handle(
        tensor, resolve_op(op, average), name, Compression.none, prescale_factor, postscale_factor, True
    )


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Reduce ``tensor`` in place across ranks and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


class _Allgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's rows of the summed incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        with collective_tag(name or ""):
            return collectives.allgather(tensor.detach())

    @staticmethod
    def backward(ctx, grad):
        summed = collectives.allreduce(grad, op="sum")
        rows = collectives.allgather_object(ctx.rows)
        offset = sum(rows[: bootstrap.rank()])
        return summed.narrow(0, offset, ctx.rows), None


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    check_process_set(process_set)
    with collective_tag(name or ""):
        return collectives.allgather_async(tensor)


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return every rank's ``tensor`` concatenated along dim 0, in rank order; differentiable."""
    check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name)
    return allgather_async(tensor, name).wait()


class _Broadcast(torch.autograd.Function):
    """Broadcast whose gradient, on the root, is the sum of every rank's incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        with collective_tag(name or ""):
            return collectives.broadcast(tensor.detach(), root_rank)

    @staticmethod
    def backward(ctx, grad):
        summed = collectives.allreduce(grad, op="sum")
        if bootstrap.rank() != ctx.root_rank:
            summed.zero_()
        return summed, None, None


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start broadcasting root's ``tensor`` into a copy; ``synchronize`` returns it."""
    check_process_set(process_set)
    with collective_tag(name or ""):
        return collectives.broadcast_async(tensor, root_rank)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every rank, leaving the argument unchanged; differentiable."""
    check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name)
    return broadcast_async(tensor, root_rank, name).wait()


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start overwriting ``tensor`` with root's in place."""
    check_process_set(process_set)
    with collective_tag(name or ""):
        return collectives.broadcast_async_(tensor, root_rank)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's on every rank and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def synchronize(handle: Handle) -> Any:
    """Wait for an ``*_async`` operation and return its output tensor."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize takes a handle from an *_async function, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """Return True if the ``*_async`` operation behind ``handle`` has finished."""
    return handle.poll()


def barrier(process_set=global_process_set) -> None:
    """Block until every rank has reached the barrier."""
    check_process_set(process_set)
    collectives.barrier()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set) -> Any:
    """Return root's picklable ``obj`` on every rank."""
    check_process_set(process_set)
    return collectives.broadcast_object(obj, root_rank)


def allgather_object(obj, name=None, process_set=global_process_set) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    check_process_set(process_set)
    return collectives.allgather_object(obj)


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    """Overwrite every rank's parameters with root's, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
        root_rank: the rank whose values everyone takes.
        process_set: only the global process set is supported.
    """
    check_process_set(process_set)
    items = list(params.items()) if isinstance(params, dict) else list(params)
    named = [item if isinstance(item, tuple) else (f"tensor.{i}", item) for i, item in enumerate(items)]
    _broadcast_parameters(named, root_rank)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set) -> None:
    """Give every rank root's optimizer state (``model`` is accepted for Horovod's signature)."""
    check_process_set(process_set)
    _broadcast_optimizer_state(optimizer, root_rank)
