"""DistributedOptimizer: bucketed, overlapped gradient allreduce around any torch optimizer."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import Variable

from . import timeline
from ._consistency import check_same_parameters
from ._optimizer_args import check_arguments, collect_parameters
from .buckets import MB, Bucket, build_buckets
from .comm.base import Communicator, Handle, ReduceOp
from .stall import collective_tag

__all__ = ["DistributedOptimizer"]

log = logging.getLogger("hpcddp")


@dataclass
class _Slot:
    """Where one parameter's gradient lives: its bucket and its view into the buffer."""

    bucket: int
    view: torch.Tensor
    name: str
    position: int
    ready: bool = False
    used: bool = False
    #: the view already holds this rank's share of the average (gradient / size)
    scaled: bool = False


@dataclass
class ReductionTimes:
    """perf_counter timestamps of the last reduction, for overlap checks and timelines."""

    backward_start: float = 0.0
    backward_end: float = 0.0
    bucket_launch: list[float] = field(default_factory=list)
    #: when each bucket's buffer went to the backend (after predivide and compression)
    bucket_submit: list[float] = field(default_factory=list)
    bucket_done: list[float] = field(default_factory=list)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap a torch optimizer so that ``step()`` applies gradients averaged over all ranks.

    Gradients live in flat bucket buffers (``param.grad`` is a view into one), filled
    in reverse parameter order as DDP does. A post-accumulate-grad hook on every
    parameter counts it ready; when a bucket is complete, and every bucket before it
    has been launched, its allreduce starts while backward continues. ``step()``
    waits for the reductions, then runs the wrapped optimizer. Results equal
    ``torch.nn.parallel.DistributedDataParallel``'s.

    A parameter that gets no gradient in a backward pass counts as a zero gradient
    on that rank (no hang, no error), so after a reduction every parameter has a
    gradient. ``zero_grad`` zeroes the buffers in place and keeps the views.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; gives names for errors and
            the registration order. Defaults to the optimizer's parameters.
        bucket_cap_mb: size limit of a bucket in MiB (DDP's 25).
        first_bucket_mb: size limit of the first bucket in MiB (DDP's 1): small, so
            communication starts early in backward.
        backward_passes_per_step: reduce once every this many backward passes,
            accumulating locally in between.
        compression: None, "fp16" or "bf16": the dtype gradients travel in.
        op: "average" (default) or "sum" across ranks.
        communicator: the Communicator to use; the one ``hpcddp.init()`` made by default.
        skip_nonfinite: after each reduction, skip the step on every rank (and zero
            the gradients) when any reduced gradient is inf or NaN; the reduced
            values are the same on every rank, so all ranks decide alike.
            ``skipped_steps`` counts the skipped steps.
        gradient_predivide_factor: with op="average", divide gradients by this
            before the sum and multiply the sum by factor / size after it (Horovod's
            knob against fp16 overflow); None divides by the world size before the
            sum, as DDP does, and needs no pass after it.

    Raises:
        ValueError: on every rank, when the ranks' parameter names, shapes or
            dtypes differ (the message names the first differing parameter).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        backward_passes_per_step: int = 1,
        compression: str | None = None,
        op: str | ReduceOp = "average",
        *,
        communicator: Communicator | None = None,
        skip_nonfinite: bool = False,
        gradient_predivide_factor: float | None = None,
    ) -> None:
        arguments = check_arguments(
            optimizer,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            backward_passes_per_step=backward_passes_per_step,
            compression=compression,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
        )
        self._op = arguments.op
        self._optimizer = optimizer
        default_comm = communicator is None
        if default_comm:
            from .bootstrap import communicator as current

            communicator = current()
        self._comm = communicator
        self.backward_passes_per_step = backward_passes_per_step
        self._named = collect_parameters(optimizer, named_parameters)
        self.times = ReductionTimes()
        self._no_sync = False
        self._set_to_none = True
        self._pass_open = False
        self._pass_reduces = False
        self._passes_since_reduce = 0
        self._handles: list[Handle] = []
        self._hooks: list[Any] = []
        self._buckets: list[Bucket] = []
        self._slots: dict[int, _Slot] = {}
        self.skip_nonfinite = bool(skip_nonfinite)
        #: steps skipped because a reduced gradient was inf or NaN (skip_nonfinite)
        self.skipped_steps = 0
        self._num_reductions = 0
        #: set by hpcddp.join(): the per-step count of ranks that still have data
        self._join_flag: torch.Tensor | None = None
        self._joined = False
        self._active_handle: Handle | None = None
        self.active_ranks = self._comm.size
        # The timeline is looked up at every use: hvd.start_timeline() may begin one later.
        self._uses_runtime = default_comm
        #: how a step's average counts ranks inside a join: "active" (those with
        #: data, hpcddp.join) or "world" (all ranks, as Horovod's and DDP's join)
        self._join_average_over = "active"
        # Gradients are divided by this before the sum and the sum multiplied by
        # predivide / size after it; the world size (DDP's choice) needs no second pass.
        self._predivide = float(self._comm.size if gradient_predivide_factor is None else gradient_predivide_factor)
        if self._comm.size > 1:
            check_same_parameters(self._comm, self._named, "DistributedOptimizer")
            self._buckets = build_buckets(
                [p for _, p in self._named],
                int(bucket_cap_mb * MB),
                int(first_bucket_mb * MB),
                arguments.wire_dtype,
            )
            self._attach()

    # -- behave like the wrapped optimizer ---------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self._optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state dict."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict into the wrapped optimizer."""
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: parameters must be known when the buckets are built."""
        raise RuntimeError(
            "DistributedOptimizer cannot add parameter groups after construction: "
            "add them to the optimizer before wrapping it"
        )

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, buckets={len(self._buckets)})"

    @property
    def _timeline(self) -> timeline.Timeline | None:
        return timeline.current() if self._uses_runtime else None

    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (empty in a world of one)."""
        return self._buckets

    @property
    def parameter_names(self) -> list[str]:
        """Names of the reduced parameters, in registration order."""
        return [name for name, _ in self._named]

    # -- hooks ------------------------------------------------------------------------------
    def _attach(self) -> None:
        names = {id(p): name for name, p in self._named}
        for bucket in self._buckets:
            for position, (param, view) in enumerate(zip(bucket.params, bucket.views)):
                slot = _Slot(bucket=bucket.index, view=view, name=names[id(param)], position=position)
                self._slots[id(param)] = slot
                _adopt_grad(param, view)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._pending = [len(b.params) for b in self._buckets]
        self._next_launch = 0

    def close(self) -> None:
        """Remove the hooks; the wrapped optimizer keeps working as a local one."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._pass_open:
            self._open_pass()
        slot = self._slots[id(param)]
        if self._pass_reduces and self._op is ReduceOp.AVERAGE and param.grad is not slot.view:
            # A fresh gradient (zero_grad set grad to None): divide it on its way
            # into the bucket, which spares a separate pass over the buffer at launch.
            torch.div(param.grad, self._predivide, out=slot.view)
            param.grad = slot.view
            slot.scaled = True
        else:
            _adopt_grad(param, slot.view)
        slot.used = True
        if not self._pass_reduces or slot.ready:
            return
        slot.ready = True
        self._pending[slot.bucket] -= 1
        if self._pending[slot.bucket] == 0:
            self._launch_ready()

    def _open_pass(self) -> None:
        if self._handles:
            raise RuntimeError(
                "a backward pass started while the previous gradients are still being reduced: "
                "call optimizer.step() (or synchronize()) after every "
                f"backward_passes_per_step={self.backward_passes_per_step} backward passes, or raise "
                "backward_passes_per_step to accumulate more passes locally"
            )
        self._pass_open = True
        self._pass_reduces = not self._no_sync and self._passes_since_reduce + 1 >= self.backward_passes_per_step
        self.times.backward_start = time.perf_counter()
        Variable._execution_engine.queue_callback(self._close_pass)

    def _close_pass(self) -> None:
        self._pass_open = False
        self._passes_since_reduce += 1
        self.times.backward_end = time.perf_counter()
        if self._pass_reduces:
            self._launch_all()

    # -- launching ----------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        # Buckets start strictly in index order so every rank issues the same
        # sequence of collectives, whatever order its gradients arrive in.
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch_all(self) -> None:
        """Launch every bucket not yet launched; unused parameters count as zero."""
        for bucket in self._buckets[self._next_launch :]:
            for param, view in zip(bucket.params, bucket.views):
                slot = self._slots[id(param)]
                if not slot.ready:
                    _adopt_grad(param, view)
                    slot.ready = True
            self._pending[bucket.index] = 0
        self._launch_ready()
        self._passes_since_reduce = 0

    def _launch(self, bucket: Bucket) -> None:
        if not self.times.bucket_launch or bucket.index == 0:
            self.times.bucket_launch = [0.0] * len(self._buckets)
            self.times.bucket_submit = [0.0] * len(self._buckets)
            self.times.bucket_done = [0.0] * len(self._buckets)
        self.times.bucket_launch[bucket.index] = time.perf_counter()
        bucket.used.copy_(torch.tensor([self._slots[id(p)].used for p in bucket.params], dtype=bucket.used.dtype))
        payload = bucket.buffer
        if self._op is ReduceOp.AVERAGE and self._predivide != 1.0:
            # Divide before summing, as DDP does: it keeps fp16 sums in range.
            unscaled = [view for param, view in zip(bucket.params, bucket.views) if not self._slots[id(param)].scaled]
            if len(unscaled) == len(bucket.views):
                payload.div_(self._predivide)
            else:
                for view in unscaled:
                    view.div_(self._predivide)
        if bucket.wire is not None:
            payload = bucket.wire.copy_(payload)
        step = self._num_reductions
        with collective_tag(f"bucket {bucket.index} of step {step}", step):
            if bucket.index == 0 and self._join_flag is not None:
                # Inside hpcddp.join(): count the ranks with data, ahead of the buckets.
                flag = self._join_flag.fill_(0 if self._joined else 1)
                self._active_handle = self._comm.allreduce_async_(flag, ReduceOp.SUM)
            self.times.bucket_submit[bucket.index] = time.perf_counter()
            self._handles.append(self._comm.allreduce_async_(payload, ReduceOp.SUM))

    # -- step --------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the reduction of the accumulated gradients (launching it if needed)."""
        if not self._buckets:
            return
        if not self._handles and self._passes_since_reduce > 0:
            self._launch_all()
        for bucket, handle in zip(self._buckets, self._handles):
            handle.wait()
            copy_out_start = time.perf_counter()
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)
            # When the backend finished it, not when we looked: that shows the overlap.
            self.times.bucket_done[bucket.index] = handle.completed_at or copy_out_start
            if self._set_to_none:
                self._drop_unused_grads(bucket)
            recorder = self._timeline
            if recorder is not None:
                recorder.bucket_reduction(
                    bucket.index,
                    self.times.bucket_launch[bucket.index],
                    self.times.bucket_submit[bucket.index],
                    handle,
                    (copy_out_start, time.perf_counter()),
                    step=self._num_reductions,
                    mib=round(bucket.nbytes / MB, 3),
                )
        if self._handles:
            self._postscale()
        self._num_reductions += bool(self._handles)
        self._reset_reduction()

    def _postscale(self) -> None:
        """Turn the reduced sums into the average the ranks agreed on."""
        if self._active_handle is not None:
            self.active_ranks = int(self._active_handle.wait().item())
            self._active_handle = None
        if self._op is not ReduceOp.AVERAGE:
            return
        divisor = self._comm.size
        # hpcddp.join(): joined ranks sent zeros, so by default the average is over
        # the ranks that still had data in this step, not over all ranks.
        if self._join_flag is not None and self._join_average_over == "active" and 0 < self.active_ranks < divisor:
            divisor = self.active_ranks
        factor = self._predivide / divisor
        if factor != 1.0:
            for bucket in self._buckets:
                bucket.grads.mul_(factor)

    def _drop_unused_grads(self, bucket: Bucket) -> None:
        # As DDP: a parameter no rank used keeps grad None (after zero_grad's
        # default set_to_none=True), so optimizers skip it instead of applying
        # momentum or weight decay to a zero gradient.
        if bool((bucket.used != 0).all()):
            return
        for param, used in zip(bucket.params, bucket.used.tolist()):
            if used == 0:
                param.grad = None

    def _reset_reduction(self) -> None:
        self._handles.clear()
        for slot in self._slots.values():
            slot.ready = False
            slot.used = False
            slot.scaled = False
        self._pending = [len(b.params) for b in self._buckets]
        self._next_launch = 0

    def step(self, closure=None):
        """Wait for the averaged gradients, then take the wrapped optimizer's step.

        Args:
            closure: passed to the wrapped optimizer's ``step``.
        """
        recorder = self._timeline
        span = _no_span if recorder is None else recorder.measure
        with span("step"):
            with span("synchronize"):
                self.synchronize()
            if self.skip_nonfinite and not self._grads_finite():
                self.skipped_steps += 1
                self.zero_grad(self._set_to_none)
                log.warning("hpcddp: skipped a step, a reduced gradient is inf or NaN (%d skipped)", self.skipped_steps)
                return None
            with span("optimizer.step"):
                return self._optimizer.step(closure)

    def _grads_finite(self) -> bool:
        if self._buckets:
            grads = [b.grads for b in self._buckets]
        else:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients as torch does; the next backward fills the bucket buffers.

        Args:
            set_to_none: as torch's: gradients become None (backward then writes
                each fresh gradient into its bucket view, already divided for the
                average, without zeroing the buffer first); with False the bucket
                buffers are zeroed in place and the views kept. After the next
                reduction, parameters that no rank used keep ``grad`` None only
                with True.
        """
        self._set_to_none = set_to_none
        if self._handles:
            # A reduction nobody stepped on: finish it so the buffers are not
            # written while the communication thread reads them.
            for handle in self._handles:
                handle.wait()
            self._reset_reduction()
        for slot in self._slots.values():
            slot.used = False
        bucketed = set(self._slots)
        for bucket in self._buckets:
            if set_to_none:
                for param in bucket.params:
                    param.grad = None
                continue
            bucket.buffer.zero_()
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not view:
                    param.grad = view
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) in bucketed or param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
        self._passes_since_reduce = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside this block, as DDP's ``no_sync()``.

        The first backward pass after the block reduces everything accumulated.
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous


def _no_span(name: str) -> contextlib.nullcontext:
    """Stand-in for ``Timeline.measure`` when no timeline is recorded."""
    return contextlib.nullcontext()


def _adopt_grad(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket view, moving any gradient autograd put elsewhere."""
    grad = param.grad
    if grad is view:
        return
    if grad is None:
        view.zero_()
    else:
        view.copy_(grad)
    param.grad = view
