"""Horovod's DistributedOptimizer and join, on hpcddp's bucketed optimizer."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import time
import warnings
import weakref
from collections.abc import Iterator

import torch

from ..collectives import tensors as collectives
from ..ddp.compression import Compressor as GradientCompressor
from ..ddp.join import shadow_until_all_joined, sync_from_last_joiner
from ..ddp.optimizer import DistributedOptimizer as _HpcddpOptimizer
from ..ddp.optimizer_args import check_backward_passes
from ..runtime import state
from .adasum_optimizer import AdasumOptimizer
from .basics import Adasum, Average, at_init, size
from .compression import OPTIMIZER_COMPRESSION, Compression
from .ops import resolve_op
from .process_sets import communicator_of, global_process_set

__all__ = ["DistributedOptimizer", "join"]

# The live DistributedOptimizers, in the order they were made (the same on every rank: making one is collective).
_optimizers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_made = itertools.count()


class _HorovodOptimizer(_HpcddpOptimizer):
    """hpcddp's DistributedOptimizer with Horovod's extras and its zero gradients for unused parameters."""

    _synchronized = False
    _skipping = False
    _process_set = global_process_set

    @property
    def _parameter_names(self) -> dict:
        """Horovod's map of each parameter to its name."""
        return {param: name for name, param in self.reducer.named}

    def synchronize(self) -> None:
        """Finish reducing the gradients now (e.g. to clip them before ``step()``).

        As Horovod's, it also reduces the gradients no hook reduced: when no backward
        pass started a reduction since the last step (gradients assigned by hand,
        ``p.grad = torch.autograd.grad(...)``), every gradient is reduced now.
        """
        self._reduce_missing()
        self._synchronized = True

    def _reduce_missing(self) -> None:
        # Horovod's synchronize() allreduces missing_p = _requires_update - set(_handles): every
        # parameter whose hook did not fire since the last synchronize. A backward pass here
        # reduces all buckets at once, so "no hook fired" is "nothing reduced since the last step".
        reducer = self.reducer
        if reducer.closed:
            return
        reducer.synchronize()
        if reducer.num_reductions == self._reductions_at_step:
            reducer.synchronize(force=True)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Mark the ``step()`` in this block as following an explicit ``synchronize()``.

        hpcddp's ``step()`` never reduces twice; Horovod's warning without the block is kept.
        """
        self._skipping = True
        try:
            yield
        finally:
            self._skipping = False

    def step(self, closure=None):
        if self._synchronized and not self._skipping:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(): "
                "wrap step() in optimizer.skip_synchronize() when you call synchronize() yourself",
                stacklevel=2,
            )
        if not self._skipping:  # as Horovod's step(): synchronize unless told it was done
            self._reduce_missing()
        self._synchronized = False
        return super().step(closure)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Reduce once every ``passes`` backward passes from now on."""
        check_backward_passes(passes)
        self.backward_passes_per_step = passes


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False,
                         process_set=global_process_set) -> torch.optim.Optimizer:  # fmt: skip
    """Return a new optimizer whose ``step()`` applies gradients reduced over all ranks (Horovod's signature).

    As in Horovod, the result is an instance of a class named as ``optimizer``'s and
    derived from it (``isinstance(opt, torch.optim.Adam)`` holds), built as
    ``type(optimizer)(optimizer.param_groups)``: it shares ``optimizer``'s parameter
    groups (lr, betas, ...) but not its state, so momenta or step counts that
    ``optimizer`` built before (e.g. by ``broadcast_optimizer_state``) start afresh.

    Gradients are fused into hpcddp's buckets (DDP's sizes) rather than Horovod's
    fusion buffer; ``num_groups`` and ``groups`` are accepted and ignored, since
    buckets already group gradients. With ``op=hvd.Adasum`` (more than one rank)
    the optimizer is Horovod's delta optimizer instead (see ``AdasumOptimizer``).

    Args:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()``.
        compression: ``Compression.none`` (default), ``.fp16``, ``.bf16``, ``.powersgd``
            or ``.int8``, or an ``hpcddp.PowerSGD(...)`` / ``hpcddp.Int8(...)`` with settings.
        backward_passes_per_step: reduce once every this many backward passes.
        op: ``Average``, ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with Average, divide by this before the sum and
            by ``size() / factor`` after it.
        num_groups: ignored (see above).
        groups: ignored (see above).
        sparse_as_dense: hand sparse gradients (``nn.Embedding(sparse=True)``) to the
            optimizer dense; by default they are reduced dense and handed to it sparse
            again, on the rows whose average is not zero.
        process_set: the ranks that reduce their gradients together (a ProcessSet);
            on ranks outside it the optimizer steps on local gradients.
    """
    check_backward_passes(backward_passes_per_step)
    reduce_op = resolve_op(op)
    if reduce_op is not Average and gradient_predivide_factor != 1.0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average, got op={op}")
    if reduce_op is Adasum and size() > 1:
        if process_set is not global_process_set:
            raise NotImplementedError(
                "DistributedOptimizer(op=hvd.Adasum) reduces over the global process set only, as in Horovod: "
                "drop process_set= or use op=hvd.Average"
            )
        if compression not in (Compression.none, Compression.fp16):  # Adasum refuses bfloat16, as Horovod's
            raise ValueError(
                f"DistributedOptimizer(op=hvd.Adasum) takes compression=hvd.Compression.none or .fp16, got {compression!r}"
            )
        fresh = _rebuild(optimizer)
        return _subclass(AdasumOptimizer, type(optimizer))(
            fresh, named_parameters, compression, backward_passes_per_step
        )
    if process_set is not None and process_set.included() is False:
        # Horovod's rule: a rank outside the set steps on its own gradients.
        from ..comm.local import LocalCommunicator

        comm = LocalCommunicator()
    else:
        comm = communicator_of(process_set)
    if isinstance(compression, GradientCompressor):
        chosen = compression
    elif compression in OPTIMIZER_COMPRESSION:
        chosen = OPTIMIZER_COMPRESSION[compression]
    else:
        raise ValueError(
            "compression must be hvd.Compression.none, .fp16, .bf16, .powersgd, .int8 or an hpcddp.PowerSGD/Int8, "
            f"got {compression!r}: custom compressors are not supported by DistributedOptimizer"
        )
    if reduce_op is Adasum:  # one rank: Horovod's plain optimizer, and the Adasum of one tensor is itself
        reduce_op = Average
    fresh = _rebuild(optimizer)
    wrapped = _subclass(_HorovodOptimizer, type(optimizer))(
        fresh,
        named_parameters,
        backward_passes_per_step=backward_passes_per_step,
        compression=chosen,
        op=reduce_op,
        gradient_predivide_factor=gradient_predivide_factor if reduce_op is Average else None,
        # The default communicator for the global set: only then does it record timelines.
        communicator=None if process_set is global_process_set else comm,
    )
    # Horovod gives a parameter that no rank used a zero gradient (so momentum and
    # weight decay still move it), where DDP and hpcddp leave it None.
    wrapped.reducer.zero_unused = True
    wrapped.reducer.keep_sparse = not sparse_as_dense
    wrapped._process_set = process_set
    _optimizers[next(_made)] = wrapped
    return wrapped


def _follow_new_communicator() -> None:
    """Move every live DistributedOptimizer of the global set to the communicator of a new ``hvd.init()``.

    Horovod's optimizer reduces through the global state, so one kept across an elastic
    reset (``hvd.shutdown(); hvd.init()``) goes on working; hpcddp's holds its
    communicator, which shutdown() closed. Collective: every rank rebuilds the same
    optimizers' buckets, in the order it made them.
    """
    # An optimizer dropped on every rank but kept alive by a reference cycle on one would
    # be rebuilt (a collective) there alone.
    gc.collect()
    comm = communicator_of(global_process_set)
    for _, optimizer in sorted(_optimizers.items()):
        if optimizer._process_set is global_process_set and not optimizer.reducer.closed:
            if optimizer.reducer.comm is not comm:
                optimizer.rebind_(comm)


at_init(_follow_new_communicator)


def _rebuild(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Return ``type(optimizer)(optimizer.param_groups)``: Horovod's fresh optimizer on the same groups.

    The groups (and so lr, betas, ... and later changes to them) are shared with
    ``optimizer``; its state (momenta, step counts) is not carried over.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if isinstance(optimizer, (_HpcddpOptimizer, AdasumOptimizer)):
        raise ValueError(f"optimizer is already a DistributedOptimizer ({name}): wrap the plain torch optimizer once")
    try:
        return type(optimizer)(optimizer.param_groups)
    except TypeError as err:
        raise TypeError(
            f"DistributedOptimizer builds a new {name}(optimizer.param_groups) as Horovod does, which failed ({err}): "
            f"give {name}.__init__'s other arguments defaults"
        ) from err


@functools.cache
def _subclass(wrapper: type, user_class: type) -> type:
    """Return the class named as ``user_class`` that is both ``wrapper`` and a ``user_class`` (Horovod's dynamic class).

    ``wrapper`` comes first: its ``step``, ``zero_grad`` and state forwarding win over
    the user class's, and ``isinstance(opt, user_class)`` holds.
    """
    return type(user_class.__name__, (wrapper, user_class), {"__doc__": wrapper.__doc__})


def join(device=-1) -> int:
    """Wait for every rank, shadowing the others' gradient reductions; return the rank that joined last.

    Call it on every rank when its data runs out. With a live ``DistributedOptimizer``
    the last rank is the one that took the most optimizer steps. Without one (mpi
    backend), a joined rank stands in for the others' ``hvd.allreduce`` calls with
    zeros (averages still divide by ``size()``) and their allgathers, broadcasts,
    alltoalls and reducescatters raise RuntimeError, as in Horovod; the last rank
    is the one that joined last. ``device`` is accepted for Horovod's signature.
    """
    optimizers = [opt for opt in list(_optimizers.values()) if opt.buckets and not opt.reducer.closed]
    if len(optimizers) > 1:
        raise RuntimeError(
            f"hvd.join() can shadow one DistributedOptimizer, found {len(optimizers)} live ones: "
            "call .close() on those no longer used"
        )
    if optimizers:
        optimizer = optimizers[0]
        joined_at = optimizer.reducer.num_reductions
        shadow_until_all_joined(optimizer)
        return sync_from_last_joiner(optimizer.reducer, joined_at)
    comm = state.communicator()
    try:
        return comm.join()
    except NotImplementedError:  # gloo/nccl: no stand-in for the others' collectives
        arrivals = collectives.allgather_object(time.time())
        return max(range(len(arrivals)), key=lambda r: (arrivals[r], r))
