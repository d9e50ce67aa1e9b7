"""Horovod's PyTorch API on hpcddp: ``import hpcddp.horovod as hvd`` in place of ``horovod.torch``.

Names, argument names and defaults follow Horovod 0.28's documented ``horovod.torch``;
the work is done by hpcddp (MPI on CPU, NCCL on GPU). Differences worth knowing:

- handles from the ``*_async`` functions are objects, not ints; pass them to
  ``synchronize`` and ``poll`` as before;
- only the global process set exists; Adasum and custom compressors are not
  supported (a clear error says so);
- ``join`` shadows the gradient reductions of the ``DistributedOptimizer``\\ s made
  here (joined ranks contribute zeros, the average divides by ``size()``, as in
  Horovod) and also takes their optimizer steps, so every rank ends with the same
  parameters; other collectives issued by the ranks still training are not
  shadowed: reduce metrics after ``join`` returns.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from . import bootstrap, collectives
from .broadcast import broadcast_optimizer_state as _broadcast_optimizer_state
from .broadcast import broadcast_parameters
from .comm.base import Handle, ReduceOp, parse_op
from .join import count_active_ranks, shadow_until_all_joined, sync_from_last_joiner
from .optimizer import DistributedOptimizer as _HpcddpOptimizer
from .stall import collective_tag

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Sum", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "cross_rank", "cross_size", "global_process_set", "init", "is_initialized", "join",
    "local_rank", "local_size", "poll", "rank", "shutdown", "size", "synchronize",
]  # fmt: skip

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX

#: Horovod's default process set: all ranks (the only one hpcddp supports)
global_process_set = "global"

_optimizers: weakref.WeakSet = weakref.WeakSet()


class Compressor:
    """Horovod's interface: ``compress`` before the allreduce, ``decompress`` after."""

    wire_dtype: str | None = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what ``decompress`` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the received tensor in its original form."""
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are."""


def _cast_compressor(dtype: torch.dtype, name: str) -> type[Compressor]:
    class _Cast(Compressor):
        wire_dtype = name

        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating_point and tensor.dtype != dtype:
                return tensor.to(dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)

    _Cast.__name__ = _Cast.__qualname__ = f"{name.upper()}Compressor"
    _Cast.__doc__ = f"Send floating-point tensors as {name}."
    return _Cast


FP16Compressor = _cast_compressor(torch.float16, "fp16")
BF16Compressor = _cast_compressor(torch.bfloat16, "bf16")


class Compression:
    """``hvd.Compression.none`` / ``.fp16`` (and hpcddp's ``.bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


# -- process layout ---------------------------------------------------------------------
def init(comm=None, process_sets=None) -> None:
    """Start hpcddp (``hpcddp.init()``); ``comm`` and ``process_sets`` must be left at None.

    Args:
        comm: Horovod's sub-communicator option; only all ranks are supported.
        process_sets: Horovod's process sets; not supported.
    """
    if comm is not None or process_sets not in (None, "dynamic"):
        raise NotImplementedError(
            "hpcddp.horovod.init supports only the global communicator: drop comm= and process_sets="
        )
    bootstrap.init()


shutdown = bootstrap.shutdown
is_initialized = bootstrap.is_initialized
size = bootstrap.size
rank = bootstrap.rank
local_size = bootstrap.local_size
local_rank = bootstrap.local_rank
cross_size = bootstrap.num_nodes
cross_rank = bootstrap.node_rank


def mpi_threads_supported() -> bool:
    """Return True when MPI runs with MPI_THREAD_MULTIPLE (hpcddp's communication thread needs it)."""
    from ._mpi import import_mpi

    MPI = import_mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Return True when collectives go through MPI."""
    return bootstrap.backend() == "mpi"


def nccl_built() -> bool:
    """Return True when torch can use NCCL."""
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def cuda_built() -> bool:
    """Return True when torch was built with CUDA."""
    return torch.version.cuda is not None


# -- collectives ---------------------------------------------------------------------------
def _check_process_set(process_set) -> None:
    if process_set is not global_process_set and process_set is not None:
        raise NotImplementedError("hpcddp.horovod supports only the global process set: drop process_set=")


def _resolve_op(op, average) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("give op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else parse_op(op)


def _allreduce_handle(tensor, average, name, compression, op, prescale_factor, postscale_factor, in_place) -> Handle:
    reduce_op = _resolve_op(op, average)
    source = tensor if in_place else tensor.detach().clone()
    if prescale_factor != 1.0:
        source.mul_(prescale_factor)
    wire, ctx = compression.compress(source)
    with collective_tag(name or ""):
        handle = collectives.allreduce_async_(wire, reduce_op)

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = compression.decompress(out, ctx)
        if postscale_factor != 1.0:
            out = out.mul_(postscale_factor)
        if out is not source:
            source.copy_(out)
        return source

    return handle.then(finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing a copy of ``tensor`` (Average by default); ``synchronize`` returns it."""
    _check_process_set(process_set)
    return _allreduce_handle(tensor, average, name, Compression.none, op, prescale_factor, postscale_factor, False)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Return the reduction of ``tensor`` across ranks (Average by default), leaving it unchanged."""
    _check_process_set(process_set)
    return _allreduce_handle(tensor, average, name, compression, op, prescale_factor, postscale_factor, False).wait()


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing ``tensor`` in place; ``synchronize`` returns it."""
    _check_process_set(process_set)
    return _allreduce_handle(tensor, average, name, Compression.none, op, prescale_factor, postscale_factor, True)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Reduce ``tensor`` in place across ranks and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    _check_process_set(process_set)
    with collective_tag(name or ""):
        return collectives.allgather_async(tensor)


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return every rank's ``tensor`` concatenated along dim 0, in rank order."""
    return allgather_async(tensor, name, process_set).wait()


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start broadcasting root's ``tensor`` into a copy; ``synchronize`` returns it."""
    _check_process_set(process_set)
    with collective_tag(name or ""):
        return collectives.broadcast_async(tensor, root_rank)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every rank, leaving the argument unchanged."""
    return broadcast_async(tensor, root_rank, name, process_set).wait()


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start overwriting ``tensor`` with root's in place."""
    _check_process_set(process_set)
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


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set) -> Any:
    """Return root's picklable ``obj`` on every rank."""
    _check_process_set(process_set)
    return collectives.broadcast_object(obj, root_rank)


def allgather_object(obj, name=None, process_set=global_process_set) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    _check_process_set(process_set)
    return collectives.allgather_object(obj)


def broadcast_optimizer_state(optimizer, root_rank, model=None) -> None:
    """Give every rank root's optimizer state (``model`` is accepted for Horovod's signature)."""
    _broadcast_optimizer_state(optimizer, root_rank)


# -- training ---------------------------------------------------------------------------------
class _HorovodOptimizer(_HpcddpOptimizer):
    """hpcddp's DistributedOptimizer with Horovod's extras (``skip_synchronize``)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` skip the wait inside this block (after an explicit ``synchronize()``).

        hpcddp's ``step()`` never reduces twice, so this only documents intent.
        """
        yield


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set) -> _HpcddpOptimizer:  # fmt: skip
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over all ranks (Horovod's signature).

    Gradients are fused into hpcddp's buckets (DDP's sizes) rather than Horovod's
    fusion buffer; ``num_groups`` and ``groups`` are accepted and ignored, since
    buckets already group gradients.

    Args:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()``.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``.
        backward_passes_per_step: reduce once every this many backward passes.
        op: ``Average`` or ``Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum and
            by ``size() / factor`` after it.
        num_groups: ignored (see above).
        groups: ignored (see above).
        sparse_as_dense: must be False: hpcddp reduces dense gradients only.
        process_set: only the global process set is supported.
    """
    _check_process_set(process_set)
    if sparse_as_dense:
        raise NotImplementedError("sparse_as_dense=True is not supported: hpcddp reduces dense gradients only")
    wire = getattr(compression, "wire_dtype", "unknown") if isinstance(compression, type) else "unknown"
    if wire == "unknown" or not issubclass(compression, Compressor):
        raise ValueError(
            f"compression must be hvd.Compression.none, .fp16 or .bf16, got {compression!r}: "
            "custom compressors are not supported"
        )
    reduce_op = parse_op(op)
    if reduce_op is not Average and gradient_predivide_factor != 1.0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average, got {op}")
    wrapped = _HorovodOptimizer(
        optimizer,
        named_parameters,
        backward_passes_per_step=backward_passes_per_step,
        compression=wire,
        op=reduce_op,
        gradient_predivide_factor=gradient_predivide_factor if reduce_op is Average else None,
    )
    # hvd.join() may come from any rank at any step: count active ranks in every reduction.
    wrapped._join_average_over = "world"
    count_active_ranks(wrapped)
    _optimizers.add(wrapped)
    return wrapped


def join(device=-1) -> int:
    """Wait for every rank, shadowing the others' gradient reductions; return the rank that joined last.

    Call it on every rank when its data runs out. ``device`` is accepted for
    Horovod's signature.
    """
    optimizers = [opt for opt in list(_optimizers) if opt.buckets and opt._hooks]  # closed ones do not reduce
    if len(optimizers) > 1:
        raise RuntimeError(
            f"hvd.join() found {len(optimizers)} live hvd.DistributedOptimizers; it can shadow one: "
            "delete the ones no longer used"
        )
    if optimizers:
        optimizer = optimizers[0]
        joined_at = optimizer._num_reductions
        shadow_until_all_joined(optimizer)
        return sync_from_last_joiner(optimizer, joined_at)
    arrivals = collectives.allgather_object(time.time())
    return max(range(len(arrivals)), key=lambda r: (arrivals[r], r))
