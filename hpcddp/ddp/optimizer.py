"""DistributedOptimizer: a torch optimizer whose gradients a Reducer averages over all ranks."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..comm.base import Communicator, ReduceOp
from ..observe import step_times, timeline
from .buckets import MB, Bucket
from .compression import Compressor
from .facade import OptimizerFacade
from .optimizer_args import check_arguments, collect_parameters
from .reducer import Reducer, ReductionTimes

__all__ = ["DistributedOptimizer"]

log = logging.getLogger("hpcddp")


class DistributedOptimizer(OptimizerFacade):
    """Wrap a torch optimizer so that ``step()`` applies gradients averaged over all ranks.

    Gradients live in flat bucket buffers (``param.grad`` is a view into one), filled
    in reverse parameter order as DDP does. A post-accumulate-grad hook on every
    parameter counts it ready; when a bucket is complete, and every bucket before it
    has been launched, its allreduce starts while backward continues. When a
    reducing backward pass ends the reduction is waited for, so after
    ``loss.backward()`` the gradients are the averages, as with DDP: GradScaler's
    ``unscale_``, gradient clipping and ``step()`` see the same numbers on every rank.
    Results equal ``torch.nn.parallel.DistributedDataParallel``'s.

    A parameter that gets no gradient in a backward pass counts as a zero gradient
    on that rank (no hang, no error); one that no rank used keeps the gradient it had
    (None after ``zero_grad``), as with DDP. ``zero_grad`` resets the gradients as
    torch's does and keeps the views. A
    parameter frozen (``requires_grad=False``) when the optimizer is built is
    reduced from the first backward pass in which it gets a gradient. A parameter
    accumulated twice in one backward pass (a weight used outside and inside a
    reentrant ``torch.utils.checkpoint``) is reduced once both accumulations are
    in: the first backward pass learns how often each parameter accumulates (and
    reduces only at its end). A gradient assigned by hand (``p.grad =
    torch.autograd.grad(...)``) to a parameter backward gave nothing since the last
    step is not averaged, as in DDP; ``step()`` then warns once, naming the parameters.
    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced dense and handed to
    the optimizer sparse, as DDP hands them (``torch.optim.SparseAdam`` trains).
    ``step()`` after a backward pass that raised part-way (an exception the script
    caught) raises ``hpcddp.StepStoppedError`` on every rank instead of averaging
    partial gradients.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; gives names for errors and
            the registration order. Defaults to the optimizer's parameters.
        bucket_cap_mb: size limit of a bucket in MiB (DDP's 25).
        first_bucket_mb: size limit of the first bucket in MiB (DDP's 1): small, so
            communication starts early in backward.
        backward_passes_per_step: reduce once every this many backward passes,
            accumulating locally in between.
        compression: None, "fp16" or "bf16" (the dtype gradients travel in);
            "powersgd" or ``hpcddp.PowerSGD(...)`` (low-rank factors, torch's
            PowerSGD hook's algorithm); "int8" or ``hpcddp.Int8(...)`` (8-bit
            blocks). Both keep what they leave out and add it to the next
            reduction (error feedback); the gradients still equal on every rank.
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
        reproducible: make training bit-identical at any world size: every backward
            pass is a micro-batch, summed exactly, and ``step()`` applies the mean over
            all micro-batches of all ranks (see ``hpcddp.reproducible``, and
            docs/reproducible.md). Compression is refused.

    Raises:
        ValueError: on every rank, when the ranks' parameter names, shapes or
            dtypes differ (the message names the first differing parameter).
    """

    # GradScaler then unscales through param_groups and calls step() only when no
    # rank's gradient overflowed, instead of handing its state to a fused step of
    # the wrapped optimizer (which would bypass this wrapper's attributes).
    _step_supports_amp_scaling = False
    _own_attributes = ("_optimizer", "reducer")
    #: made with reproducible=True (a ``hpcddp.reproducible.optimizer.ReproducibleOptimizer``)
    reproducible = False
    #: the reducer's ``num_reductions`` at the last step: unchanged at a step, nothing was reduced for it
    _reductions_at_step = 0
    _warned_outside = False
    #: this rank's step times for the straggler reports (``hpcddp.observe.step_times``); None: off
    _step_times = None

    #: the subclass ``reproducible=True`` makes; ``hpcddp.reproducible.optimizer`` sets it when imported
    #: (it builds on this module, which so need not import it back)
    reproducible_class: type | None = None

    def __new__(cls, *args: Any, reproducible: bool = False, **kwargs: Any):
        if not isinstance(reproducible, bool):
            raise TypeError(f"reproducible must be True or False, got {reproducible!r}")
        if reproducible and not cls.reproducible:
            if DistributedOptimizer.reproducible_class is None:
                raise RuntimeError("reproducible=True needs hpcddp.reproducible: import hpcddp, not hpcddp.ddp alone")
            cls = DistributedOptimizer.reproducible_class
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        backward_passes_per_step: int = 1,
        compression: str | Compressor | None = None,
        op: str | ReduceOp = "average",
        *,
        communicator: Communicator | None = None,
        skip_nonfinite: bool = False,
        gradient_predivide_factor: float | None = None,
        reproducible: bool = False,
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
        self._optimizer = optimizer
        default_comm = communicator is None
        if default_comm:
            from ..runtime.state import communicator as current

            communicator = current()
        self._gradient_predivide_factor = gradient_predivide_factor
        self._step_times = step_times.recorder_for(communicator, record_timeline=default_comm)
        self._reducer_options = {
            "op": arguments.op,
            "bucket_cap_bytes": int(bucket_cap_mb * MB),
            "first_bucket_bytes": int(first_bucket_mb * MB),
            "wire_dtype": arguments.wire_dtype,
            "compressor": arguments.compressor,
            # The timeline is looked up at every use: hvd.start_timeline() may begin one later.
            "record_timeline": default_comm,
            "after_reduction": None if self._step_times is None else self._step_times.reduction_done,
        }
        #: the object that reduces the gradients (buckets, hooks, join state)
        self.reducer = self._make_reducer(
            collect_parameters(optimizer, named_parameters), communicator, backward_passes_per_step
        )
        self._records_timeline = default_comm
        self.skip_nonfinite = bool(skip_nonfinite)
        #: steps skipped because a reduced gradient was inf or NaN (skip_nonfinite)
        self.skipped_steps = 0
        self._warned_nonfinite = False

    def _make_reducer(self, named, communicator: Communicator, backward_passes_per_step: int) -> Reducer:
        factor = self._gradient_predivide_factor
        predivide = communicator.size if factor is None else factor
        return Reducer(
            named,
            communicator,
            predivide=float(predivide),
            backward_passes_per_step=backward_passes_per_step,
            **self._reducer_options,
        )

    def rebind_(self, communicator: Communicator) -> None:
        """Reduce over ``communicator`` from now on, in new buckets (collective on its ranks).

        For a communicator of the same ranks made after ``hpcddp.shutdown()`` and
        ``init()`` (Horovod's elastic reset): the gradients move to the new buckets, a
        reduction begun on the old communicator is dropped, compression memory and the
        step count start afresh, as on a new optimizer; the wrapped optimizer's state stays.

        Args:
            communicator: the new communicator.
        """
        old = self.reducer
        old.close()
        self.reducer = self._make_reducer(old.named, communicator, old.backward_passes_per_step)
        self.reducer.take_settings_of(old)

    # -- behave like the wrapped optimizer (the rest is OptimizerFacade's) -----------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: parameters must be known when the buckets are built."""
        raise RuntimeError(
            "DistributedOptimizer cannot add parameter groups after construction: "
            "add them to the optimizer before wrapping it"
        )

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, buckets={len(self.buckets)})"

    # -- the reduction, through the reducer ------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (empty in a world of one)."""
        return self.reducer.buckets

    @property
    def parameter_names(self) -> list[str]:
        """Names of the reduced parameters, in registration order."""
        return self.reducer.reduced_names

    @property
    def times(self) -> ReductionTimes:
        """Timestamps of the last reduction (backward, every bucket's launch and completion)."""
        return self.reducer.times

    @property
    def backward_passes_per_step(self) -> int:
        """Reduce once every this many backward passes."""
        return self.reducer.backward_passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.reducer.backward_passes_per_step = passes

    def synchronize(self) -> None:
        """Finish the reduction of the accumulated gradients (launching it if needed)."""
        self.reducer.synchronize()

    def close(self) -> None:
        """Remove the hooks; the wrapped optimizer keeps working as a local one."""
        self.reducer.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside this block, as DDP's ``no_sync()``.

        The first backward pass after the block reduces everything accumulated.
        """
        with self.reducer.no_sync():
            yield

    # -- step --------------------------------------------------------------------------------
    def step(self, closure=None):
        """Wait for the averaged gradients, then take the wrapped optimizer's step.

        Every ``HPCDDP_STRAGGLER_EVERY`` steps it also reports stragglers (``hpcddp.straggler_report``).

        Args:
            closure: passed to the wrapped optimizer's ``step``.
        """
        started = time.perf_counter()
        try:
            return self._reduced_step(closure)
        finally:
            if self._step_times is not None:
                if self.reducer.closed:
                    self._step_times.stop()
                else:  # local: a row for this step if its reduction finished (the report is the reducer's)
                    self._step_times.step_done(
                        started, self.reducer.times, self.reducer.num_reductions, self.reducer.named
                    )

    def _reduced_step(self, closure):
        """``step()`` itself: wait for the reduction, check it, step the wrapped optimizer."""
        recorder = timeline.current() if self._records_timeline else None
        span = _no_span if recorder is None else recorder.measure
        with span("step"):
            self.reducer.synchronize()  # a no-op after a reducing backward pass, which waited itself
            self._warn_grads_outside()
            self.reducer.start_step()
            self._reductions_at_step = self.reducer.num_reductions
            self.reducer.steps_taken += 1
            nonfinite = self.reducer.nonfinite_ranks
            if self.skip_nonfinite and not self._grads_finite():
                self.skipped_steps += 1
                self.zero_grad(self.reducer.set_to_none)
                log.warning(
                    "hpcddp: skipped a step, a reduced gradient is inf or NaN%s (%d skipped)",
                    _naming(nonfinite),
                    self.skipped_steps,
                )
                return None
            self._warn_nonfinite(nonfinite)
            with span("optimizer.step"), self.reducer.sparse_grads() as sparsify:
                if closure is None:
                    return self._optimizer.step()

                def closure_then_sparse():
                    # The closure's backward puts the dense bucket views back (and may be the first
                    # to give a sparse gradient): the optimizer sees them sparse again.
                    loss = closure()
                    self.reducer.synchronize()
                    sparsify()
                    return loss

                return self._optimizer.step(closure_then_sparse)

    def _warn_grads_outside(self) -> None:
        if self._warned_outside or not (names := self.reducer.grads_outside_buckets()):
            return
        self._warned_outside = True
        shown = ", ".join(repr(name) for name in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        log.warning(
            "hpcddp: step() found gradients that no backward hook reduced, assigned by hand (%s): each rank "
            "steps on its own, as with torch DDP, and the replicas drift apart; compute them with loss.backward(), "
            "or average them first (hpcddp.allreduce(p.grad, op='average')); hvd.DistributedOptimizer averages them "
            "when no backward pass ran since the last step",
            shown,
        )

    def _warn_nonfinite(self, ranks: list[int]) -> None:
        # Once when it starts: the steps after it are NaN on every rank as a consequence.
        if ranks and not self._warned_nonfinite:
            log.warning(
                "hpcddp: the local gradient of rank %d was inf or NaN in reduction %d%s, so the averaged "
                "gradient applied on every rank is too: find why that rank's loss is not finite, or pass "
                "skip_nonfinite=True to skip such steps",
                ranks[0],
                self.reducer.num_reductions - 1,
                "" if len(ranks) == 1 else f" (also ranks {', '.join(map(str, ranks[1:]))})",
            )
        self._warned_nonfinite = bool(ranks)

    def _grads_finite(self) -> bool:
        grads = self.reducer.grads()
        if not grads:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients as torch does; the next backward fills the bucket buffers.

        Args:
            set_to_none: as torch's: gradients become None (backward then writes
                each fresh gradient into its bucket view, already divided for the
                average, without zeroing the buffer first); with False the bucket
                buffers are zeroed in place and the views kept, and a gradient that
                is None stays None, as torch's.
        """
        self.reducer.zero_grad(set_to_none)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None or self.reducer.holds(param):
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()


def _naming(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f" (local gradient non-finite on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def _no_span(name: str) -> contextlib.nullcontext:
    """Stand-in for ``Timeline.measure`` when no timeline is recorded."""
    return contextlib.nullcontext()
