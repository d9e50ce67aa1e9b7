"""Horovod's allgather (and the sparse allreduce built on it), broadcast, alltoall and reducescatter
(plain, grouped, differentiable as Horovod's)."""

from __future__ import annotations

import functools

import torch

from ..comm.base import Handle, parse_op
from .basics import Adasum, Average, Sum
from .compression import Compression
from .ops import resolve_op, scale_, start, start_each, start_group, wait_all
from .process_sets import communicator_of, global_process_set, set_rank

__all__ = [
    "allgather", "allgather_async", "alltoall", "alltoall_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "reducescatter", "reducescatter_async", "sparse_allreduce_async",
]  # fmt: skip


# -- allgather -----------------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    comm = communicator_of(process_set)
    return start(
        name, "allgather", process_set, lambda label: comm.allgather_async(tensor.detach(), check=label, label=label)
    )


class _Allgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's rows of the incoming gradient averaged over ranks (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return allgather_async(tensor, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        comm = communicator_of(ctx.process_set)
        averaged = comm.allreduce_async_(grad.detach().clone(), Average, check="").wait()
        rows = comm.allgather_object(ctx.rows)
        return averaged.narrow(0, sum(rows[: comm.rank]), ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return every rank's ``tensor`` concatenated along dim 0, in rank order; differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name, process_set)
    return allgather_async(tensor, name, process_set).wait()


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    """Start one allgather per tensor; ``synchronize`` returns the list of results."""
    members = [functools.partial(allgather_async, t, process_set=process_set) for t in tensors]
    return start_group(name, "allgather", process_set, members)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """Return the allgather of each tensor in ``tensors``; differentiable."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO tensor as Horovod does: allgather its indices and values.

    Returns a function; calling it waits and returns the sparse result (duplicate
    indices summed when coalesced; divided by the set's size for Average).
    """
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates rows: indices travel transposed, one row per nonzero.
    indices, values = start_each(  # a values gather refused at its start (gloo) leaves no indices gather behind
        [
            lambda: allgather_async(sparse.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set),
            lambda: allgather_async(sparse.values(), name=f"{name}.values", process_set=process_set),
        ]
    )
    size = communicator_of(process_set).size

    def finish() -> torch.Tensor:
        gathered_values, gathered_indices = wait_all([values, indices])  # both synchronized, also when one raised
        if parse_op(op) is Average:
            gathered_values = gathered_values / size
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape, check_invariants=True)

    return finish


# -- broadcast -----------------------------------------------------------------------
def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start overwriting ``tensor`` with root's in place (``root_rank`` is a global rank, as in Horovod)."""
    comm = communicator_of(process_set)
    root = set_rank(process_set, root_rank)
    handle = start(
        name,
        "broadcast",
        process_set,
        lambda label: comm.broadcast_async_(tensor.detach(), root, check=label, label=label),
    )
    return handle.then(lambda _: tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start broadcasting root's ``tensor`` into a copy; ``synchronize`` returns it."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    """Broadcast whose gradient, on the root, is the average of every rank's incoming gradient (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        comm = communicator_of(ctx.process_set)
        averaged = comm.allreduce_async_(grad.detach().clone(), Average, check="").wait()
        if comm.rank != set_rank(ctx.process_set, ctx.root_rank):
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every rank, leaving the argument unchanged; differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return broadcast_async(tensor, root_rank, name, process_set).wait()


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's on every rank and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# -- alltoall ------------------------------------------------------------------------
def _splits_list(splits, comm) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex:
            raise ValueError(f"splits must hold integers (torch.int32, as Horovod's), got {splits.dtype}")
        return splits.tolist()
    return list(splits)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start sending ``splits[r]`` rows of ``tensor`` to each rank r (even split without ``splits``);
    ``synchronize`` returns ``(output, received_splits)``."""
    comm = communicator_of(process_set)
    rows = _splits_list(splits, comm)
    if rows is None and tensor.dim() > 0 and tensor.shape[0] % comm.size:
        raise ValueError(
            f"alltoall without splits needs a first dimension divisible by {comm.size} ranks, "
            f"got {tensor.shape[0]}: pass splits"
        )
    if rows is not None and (len(rows) != comm.size or sum(rows) != (tensor.shape[0] if tensor.dim() else 1)):
        raise ValueError(f"splits must be {comm.size} row counts adding up to the first dimension, got {rows}")
    received_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    handle = start(
        name,
        "alltoall",
        process_set,
        lambda label: comm.alltoall_async(tensor.detach(), rows, check=label, label=label),
    )
    return handle.then(lambda out: (out[0], out[1].to(received_dtype)))


class _Alltoall(torch.autograd.Function):
    """Alltoall whose gradient sends the incoming gradient's rows back where they came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = alltoall_async(tensor, splits, name, process_set).wait()
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set).wait()
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Return the rows every rank sent here; with ``splits``, also how many came from each rank.

    Differentiable: the gradient goes back along the same routes.
    """
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = alltoall_async(tensor, splits, name, process_set).wait()
    return output if splits is None else (output, received)


# -- reducescatter -------------------------------------------------------------------
def _reducescatter_handle(tensor, op, name, process_set, prescale, postscale) -> Handle:
    comm = communicator_of(process_set)
    op = resolve_op(op)
    if op is Adasum:
        # Horovod fails it in its background thread (a RuntimeError), not as bad input.
        raise NotImplementedError(
            "reducescatter does not support op=hvd.Adasum, as in Horovod: use hvd.Sum or hvd.Average"
        )
    if op not in (Sum, Average):
        raise ValueError(f"reducescatter supports op=hvd.Sum or hvd.Average, got {op}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")
    source = tensor.detach()
    if prescale != 1.0:
        source = scale_(source.clone(), prescale)
    integer_average = op is Average and not source.dtype.is_floating_point
    reduce_op = Sum if integer_average else op
    handle = start(
        name,
        "reducescatter",
        process_set,
        lambda label: comm.reducescatter_async(source, reduce_op, check=label, label=label),
    )

    def finish(out: torch.Tensor) -> torch.Tensor:
        if integer_average:
            out.div_(comm.size, rounding_mode="trunc")
        return scale_(out, postscale)

    return handle.then(finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:  # fmt: skip
    """Start reducing ``tensor`` and keeping this rank's rows (the first ``rows % size`` ranks get one more)."""
    return _reducescatter_handle(tensor, op, name, process_set, prescale_factor, postscale_factor)


class _Reducescatter(torch.autograd.Function):
    """Reducescatter whose gradient is the allgather of the incoming gradient, scaled as the forward was."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (resolve_op(op), process_set, prescale, postscale)
        return _reducescatter_handle(tensor, op, name, process_set, prescale, postscale).wait()

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        comm = communicator_of(process_set)
        scale = prescale * postscale * (comm.size if op is Sum else 1)
        gathered = comm.allgather_async((grad * scale).contiguous(), check="").wait()
        return gathered, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:  # fmt: skip
    """Return this rank's rows of the reduction of ``tensor`` (Average by default); differentiable."""
    wire, ctx = compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        reduced = _Reducescatter.apply(wire, name, op, process_set, prescale_factor, postscale_factor)
    else:
        reduced = _reducescatter_handle(wire, op, name, process_set, prescale_factor, postscale_factor).wait()
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> Handle:  # fmt: skip
    """Start one reducescatter per tensor; ``synchronize`` returns the list of results."""
    members = [
        functools.partial(
            _reducescatter_handle, t, op, process_set=process_set, prescale=prescale_factor, postscale=postscale_factor
        )
        for t in tensors
    ]
    return start_group(name, "reducescatter", process_set, members)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:  # fmt: skip
    """Return the reducescatter of each tensor in ``tensors``; differentiable."""
    return [
        reducescatter(
            t, None if name is None else f"{name}.{i}", compression, op, process_set, prescale_factor, postscale_factor
        )  # fmt: skip
        for i, t in enumerate(tensors)
    ]
