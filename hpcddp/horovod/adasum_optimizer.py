"""Horovod's ``DistributedOptimizer(op=hvd.Adasum)``: step locally, then Adasum the parameters' changes."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from ..ddp.facade import OptimizerFacade
from ..ddp.optimizer_args import check_backward_passes, collect_parameters
from .adasum import adasum_async, check_adasum
from .compression import Compression
from .process_sets import communicator_of, global_process_set

__all__ = ["AdasumOptimizer"]


def _call_if_alive(method: weakref.WeakMethod, param: torch.Tensor) -> None:
    bound = method()
    if bound is not None:
        bound(param)


class AdasumOptimizer(OptimizerFacade):
    """Apply on every rank the Adasum of the ranks' local updates (Horovod 0.28.1's delta optimizer).

    ``step()`` takes the wrapped optimizer's step on this rank's own gradients, reduces
    each trainable parameter's change (new value - old value) with Adasum over all
    ranks, one reduction per parameter, and sets the parameter to its old value plus
    that reduction, in the parameter's dtype, as Horovod does. Gradients are not
    averaged. Every trainable parameter gets a zero gradient when the optimizer is
    built (Horovod's rule), so one that no backward pass reached still steps.

    Horovod steps each parameter as soon as its gradient is complete; hpcddp steps all
    of them in ``step()`` (the same numbers for optimizers whose update of a parameter
    depends on that parameter alone: SGD, Adam, AdamW, RMSprop, ...), and the
    reductions run there too, not during backward.

    Args:
        optimizer: the torch optimizer that makes the local step.
        named_parameters: ``model.named_parameters()``, or None.
        compression: ``hvd.Compression.none`` or ``.fp16``: the dtype the changes
            travel in.
        backward_passes_per_step: the backward passes allowed between steps
            (gradients accumulate locally over them).
    """

    _step_supports_amp_scaling = False

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1):
        check_backward_passes(backward_passes_per_step)
        self._optimizer = optimizer
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._named = [(name, p) for name, p in collect_parameters(optimizer, named_parameters) if p.requires_grad]
        for dtype in {compression.compress(torch.empty(0, dtype=p.dtype))[0].dtype for _, p in self._named}:
            check_adasum(self._comm.size, dtype)
        self._passes = {param: 0 for _, param in self._named}
        self._hooks = []
        # A weak reference: the parameters' hooks must not keep a dropped optimizer alive.
        count_pass = weakref.WeakMethod(self._count_pass)
        for _, param in self._named:
            param.grad = torch.zeros_like(param)
            self._hooks.append(param.register_post_accumulate_grad_hook(lambda p: _call_if_alive(count_pass, p)))

    @property
    def _comm(self):
        # Looked up at every step, as Horovod's global state: after hvd.shutdown(); hvd.init() it is the new one.
        return communicator_of(global_process_set)

    def _count_pass(self, param: torch.Tensor) -> None:
        self._passes[param] += 1
        if self._passes[param] > self.backward_passes_per_step:
            raise AssertionError(
                f"a gradient was computed {self._passes[param]} times before step(), more than "
                f"backward_passes_per_step={self.backward_passes_per_step}: raise it to accumulate gradients locally"
            )

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Allow ``passes`` backward passes between steps from now on."""
        check_backward_passes(passes)
        self.backward_passes_per_step = passes

    def step(self, closure=None):
        """Step locally, then set every parameter to its old value plus the Adasum of the ranks' changes.

        Args:
            closure: called once first, as Horovod does; its loss is returned.
        """
        loss = closure() if closure is not None else None
        with torch.no_grad():
            starts = [param.detach().clone() for _, param in self._named]
            self._optimizer.step()
            pending = []
            for (name, param), start in zip(self._named, starts):
                wire, ctx = self._compression.compress(param.detach() - start)
                pending.append((adasum_async(self._comm, wire, check=name), ctx))
            for (_, param), start, (handle, ctx) in zip(self._named, starts, pending):
                param.copy_(start.add_(self._compression.decompress(handle.wait(), ctx)))
        self._passes = dict.fromkeys(self._passes, 0)
        return loss

    def synchronize(self) -> None:
        """Do nothing: the reductions belong to ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Refuse, as Horovod does: with Adasum ``step()`` is what reduces."""
        raise AssertionError("optimizer.skip_synchronize() does not apply with op=hvd.Adasum: call step() alone")
        yield  # pragma: no cover - makes this a generator

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients as the wrapped optimizer does."""
        self._optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group) -> None:
        """Not supported: the parameters are fixed when the optimizer is built."""
        raise RuntimeError(
            "DistributedOptimizer(op=hvd.Adasum) cannot add parameter groups after construction: "
            "add them to the optimizer before wrapping it"
        )

    def close(self) -> None:
        """Remove the gradient hooks; the wrapped optimizer keeps working as a local one."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, op=Adasum)"
