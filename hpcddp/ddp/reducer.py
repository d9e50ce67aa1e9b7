"""The gradient reduction behind DistributedOptimizer: buckets, hooks, launch order, waiting, join state.

One ``Reducer`` owns the reduction of a set of parameters, as DDP's C++ Reducer does:

- every parameter's gradient lives in a bucket view; a post-accumulate-grad hook
  counts it ready, and a bucket is launched (strictly in index order) once all its
  parameters are ready, while backward goes on (the last bucket at the end of the pass);
- the first backward pass launches nothing early: it learns how often each parameter
  accumulates per pass (twice for a weight used outside and inside a reentrant
  torch.utils.checkpoint), as DDP's static_graph does;
- at the end of a reducing backward pass the rest is launched and waited for, so
  gradients are final when ``backward()`` returns, as with DDP (GradScaler.unscale_,
  gradient clipping and logging see the averaged gradients);
- the last bucket carries a few control numbers along with the gradients (join,
  unfrozen parameters, non-finite gradients: ``control``), no extra collective per step.

Where one reduction stands is a ``Phase`` (IDLE, PASS, LAUNCHED, REFUSED), described in
docs/architecture.md ("The reducer's states"); hooks change it under ``_lock``, the training thread between passes.

Every rank therefore launches the same buckets in the same order, each tagged with the
optimizer's step, and the ranks compare the step once, at bucket 0, through the
communicator's gradient channel: on MPI the buckets run on a communicator of their own
(``hpcddp.comm.mpi.gradient_channel``: why that is enough); on gloo and nccl on the
optimizer's group, the agreement answered at bucket 0 on CPUs and read before the sums
are used on GPUs (``hpcddp.comm.torchdist_channel``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..comm.agreement import CollectiveMismatchError
from ..comm.base import Communicator, Handle, ReduceOp, ranks_text
from ..observe import timeline
from .autograd_hooks import at_end_of_backward
from .buckets import Bucket, adopt_grad, build_buckets, drop_unused_grads
from .compression import Compressor
from .consistency import check_same_layout, check_same_parameters, next_optimizer_label
from .control import ControlNumbers
from .sending import BucketSender
from .slots import (
    IN_PLACE_BYTES,
    GradSlot,
    fill_bucket,
    grads_outside,
    hand_views,
    note_grads_present,
    reset_grads,
    write_used,
)
from .timing import ReductionTimes
from .trainable import average_loose_grads, require_trainable, watch_frozen

__all__ = ["Phase", "ReductionTimes", "Reducer", "StepStoppedError"]


class StepStoppedError(RuntimeError):
    """Some rank stopped part-way through a step; every rank raises this at the end of that step."""


class Phase(enum.Enum):
    """Where a reducer's current reduction stands (docs/architecture.md, "The reducer's states")."""

    #: no backward pass open and no bucket in flight
    IDLE = "idle"
    #: a backward pass is open: gradients land in their bucket views and full buckets may already be in flight
    PASS = "pass"
    #: the pass ended (or ``synchronize`` launched without one): every bucket is in flight, not yet waited for
    LAUNCHED = "launched"
    #: every rank refused this step (some rank stopped part-way): nothing reduces or steps until ``zero_grad``
    REFUSED = "refused"


log = logging.getLogger("hpcddp")


class Reducer:
    """Average (or sum) the gradients of ``named`` parameters over all ranks, bucket by bucket.

    Args:
        named: (name, parameter) pairs in registration order; those with
            ``requires_grad=False`` are watched and join the buckets once they
            receive a gradient.
        comm: the communicator.
        op: ``ReduceOp.AVERAGE`` or ``ReduceOp.SUM``.
        bucket_cap_bytes: size limit of a bucket.
        first_bucket_bytes: size limit of the first bucket.
        wire_dtype: the dtype gradients travel in, or None.
        compressor: how buckets are compressed (PowerSGD, int8), or None.
        predivide: gradients are divided by this before the sum and the sum
            multiplied by ``predivide / size`` after it (op AVERAGE).
        backward_passes_per_step: reduce once every this many backward passes.
        record_timeline: record bucket reductions in ``hpcddp.observe.timeline``.
        after_reduction: called with (``num_reductions``, ``active_ranks``, the buckets'
            communicator) when each reduction completes, before it returns, on every rank alike
            (the straggler reports' ``StepTimeRecorder.reduction_done``, which may gather there).
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.nn.Parameter]],
        comm: Communicator,
        *,
        op: ReduceOp,
        bucket_cap_bytes: int,
        first_bucket_bytes: int,
        wire_dtype: torch.dtype | None,
        predivide: float,
        compressor: Compressor | None = None,
        backward_passes_per_step: int = 1,
        record_timeline: bool = False,
        after_reduction: Callable[[int, int, Communicator], None] | None = None,
    ) -> None:
        self.comm = comm
        self.named = list(named)
        self.backward_passes_per_step = backward_passes_per_step
        self.times = ReductionTimes()
        #: reductions completed so far
        self.num_reductions = 0
        #: optimizer steps taken (or skipped) so far: the step each bucket belongs to, which the
        #: ranks compare before reducing it (a rank that skipped a backward pass but stepped is
        #: a step ahead, with buckets of the same shapes)
        self.steps_taken = 0
        #: ranks that had data in the last reduction (hpcddp.join)
        self.active_ranks = comm.size
        #: ranks whose local gradient was inf or NaN in the last reduction
        self.nonfinite_ranks: list[int] = []
        #: False while this rank only shadows the others (hpcddp.join): it sends zeros
        self.has_data = True
        #: average over the ranks that had data instead of over all ranks (hpcddp.join)
        self.divide_by_active = False
        #: give parameters that no rank used a zero gradient (Horovod) instead of None (DDP)
        self.zero_unused = False
        #: the ``set_to_none`` of the last ``zero_grad``
        self.set_to_none = True
        #: hand gradients that backward gave sparse to the optimizer sparse (DDP); False: dense
        #: (Horovod's sparse_as_dense)
        self.keep_sparse = True
        self._op = op
        self._predivide = predivide
        #: what each gradient is multiplied by before the sum (the division by predivide, as DDP's
        #: product by the reciprocal), or None
        self._scale = 1.0 / predivide if op is ReduceOp.AVERAGE and predivide != 1.0 else None
        self._owner = next_optimizer_label(comm)
        self._lock = threading.RLock()
        self._bucket_args = (bucket_cap_bytes, first_bucket_bytes, wire_dtype)
        # Where the buckets run, checked once per step (Communicator.gradient_channel); None: not checked (one rank).
        self._channel = comm.gradient_channel() if comm.size > 1 else None
        if self._channel is not None:
            weakref.finalize(self, self._channel.close)
        self._sender = BucketSender(comm if self._channel is None else self._channel.comm, compressor)
        self._record_timeline = record_timeline
        self._after_reduction = after_reduction
        self._sync = True
        self._phase = Phase.IDLE
        self._pass_reduces = False
        self._pass_id = 0
        self._passes_since_reduce = 0
        self._learning = True
        self._saw_new_trainable = False
        self._handles: list[Handle] = []
        self._hooks: list[Any] = []
        self._buckets: list[Bucket] = []
        self._slots: dict[int, GradSlot] = {}
        self._bucket_slots: list[list[GradSlot]] = []
        self._all_slots: list[GradSlot] = []
        #: device -> (parameter, slot) of the small gradients autograd may add into their view (``hand_views``)
        self._in_place: dict[torch.device, list[tuple[torch.nn.Parameter, GradSlot]]] = {}
        #: no view holds a gradient (zero_grad() since the last launch): hand_views may zero them
        self._views_free = False
        #: per bucket, what its launch left to scale where it is sent
        self._unscaled: list[list[torch.Tensor]] = []
        self._control = ControlNumbers(comm.rank, comm.size, 1.0 if self._scale is None else self._scale)
        self._pending: list[int] = []
        self._next_launch = 0
        #: launch a bucket from its last hook; False: bucket 0 there, the rest at the end of the pass
        #: (``BucketSender.overlap``)
        self._launch_in_backward = True
        #: id -> (parameter, sparse dims) of the parameters whose gradient backward gives sparse
        #: (nn.Embedding(sparse=True)): reduced dense, handed to the optimizer sparse (sparse_grads)
        self._sparse: dict[int, tuple[torch.nn.Parameter, int]] = {}
        #: why every rank refused this step (the StepStoppedError of Phase.REFUSED)
        self._refusal = ""
        if comm.size > 1:
            trainable = require_trainable(self.named)
            check_same_parameters(comm, trainable, "DistributedOptimizer")
            self._build(trainable)

    # -- public ---------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (empty in a world of one)."""
        return self._buckets

    @property
    def phase(self) -> Phase:
        """Where the current reduction stands."""
        return self._phase

    @property
    def reduced_names(self) -> list[str]:
        """Names of the parameters in the buckets, in registration order."""
        return [name for name, param in self.named if id(param) in self._slots]

    def holds(self, param: torch.Tensor) -> bool:
        """Return True if ``param``'s gradient lives in a bucket."""
        return id(param) in self._slots

    def grads(self) -> list[torch.Tensor]:
        """The flat gradient tensors of the buckets (views of their buffers)."""
        return [bucket.grads for bucket in self._buckets]

    def grads_outside_buckets(self) -> list[str]:
        """Names of the parameters whose gradient was assigned by hand since the last step (no hook saw it)."""
        return grads_outside(self._buckets, self._bucket_slots)

    def start_step(self) -> None:
        """A step was taken: gradients from backward count from here (``grads_outside_buckets``)."""
        for slot in self._slots.values():
            slot.landed = False

    @contextlib.contextmanager
    def sparse_grads(self) -> Iterator[Callable[[], None]]:
        """Inside the block, gradients that backward gave sparse are sparse again, as DDP hands them.

        They are reduced dense, in their bucket; optimizers that take only sparse
        gradients (``torch.optim.SparseAdam``) step on the rows some rank's average is
        not zero in. The block yields the function that does it, for gradients a closure
        computes inside it. After the block each gradient is its bucket view again.
        """
        made: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

        def sparsify() -> None:
            for param, sparse_dim in self._sparse.values():
                grad = param.grad
                if self.keep_sparse and grad is not None and not grad.is_sparse:
                    param.grad = grad.to_sparse(sparse_dim)
                    made.append((param, grad))

        sparsify()
        try:
            yield sparsify
        finally:
            for param, grad in reversed(made):
                param.grad = grad

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate locally inside the block; the first pass after it reduces everything."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def synchronize(self, force: bool = False) -> None:
        """Finish the reduction of the accumulated gradients, launching it if needed.

        Args:
            force: reduce even when no backward pass ran since the last reduction
                (a rank that shadows the others in hpcddp.join sends zeros).
        """
        if not self._buckets:
            return
        if self._phase is Phase.REFUSED:  # every rank refused this step: none may reduce or step on it
            raise StepStoppedError(self._refusal)
        if self._phase is Phase.PASS:
            self._refuse_unfinished_pass()
        started = time.perf_counter()
        if not self._handles and (force or self._passes_since_reduce > 0):
            self._open_window()  # a rank that joined reduces without a pass of its own
            self._pass_reduces = True
            self._launch_all()
        if self._handles:
            self._finish(started)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the bucketed gradients as torch's ``zero_grad`` does, keeping the views.

        Args:
            set_to_none: gradients become None (the next backward writes each fresh
                gradient into its view); False zeroes the buffers and keeps the views.
        """
        self.set_to_none = set_to_none
        if self._handles:
            self._finish_abandoned()
            self._reset_reduction()
        elif (
            self._phase is Phase.PASS
            and self._pass_reduces
            and self._channel is not None
            and self._sender.compressor is None
        ):
            # A pass that stopped (an exception in backward) before it launched a bucket: the other
            # ranks wait in the step's buckets, as when some had left, and every rank refuses it alike.
            self._send_rest_stopped()
            self._reset_reduction()
        elif self._phase is Phase.PASS:
            # Nobody waits for it (no reduction in this pass, or one rank): its gradients are dropped
            # here, so the next backward opens a pass of its own. Compressed: the others wait in bucket 0,
            # which the retried batch's buckets then complete.
            self._reset_reduction()
        for slot in self._slots.values():
            slot.used = False
            slot.scaled = False
        reset_grads(self._buckets, set_to_none)
        self._views_free = bool(self._buckets)
        self._passes_since_reduce = 0
        self._phase, self._refusal = Phase.IDLE, ""

    def close(self) -> None:
        """Remove the hooks and free the buckets' communicator: the parameters' gradients stay local from now on."""
        self._remove_hooks()
        if self._channel is not None:
            self._channel.close()

    def take_settings_of(self, old: Reducer) -> None:
        """Keep ``old``'s settings and what it learned of the parameters (a rebind to a new communicator)."""
        self.zero_unused = old.zero_unused
        self.keep_sparse = old.keep_sparse
        self._sparse.update(old._sparse)

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @property
    def closed(self) -> bool:
        """True once ``close()`` removed the hooks (or there were none to install)."""
        return not self._hooks

    # -- building -------------------------------------------------------------------------
    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.named if p.requires_grad]

    def _build(self, trainable: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Make buckets for ``trainable`` and hook every parameter, watching the frozen ones."""
        cap, first, wire_dtype = self._bucket_args
        buckets = build_buckets([p for _, p in trainable], cap, first, wire_dtype, self._control.size)
        if self._channel is not None:  # buckets are not compared one by one: their layout is, once
            check_same_layout(self.comm, buckets, self._sender.compressor, "DistributedOptimizer")
        self._remove_hooks()  # after the check: a rebuild refused on every rank keeps the old buckets
        self._buckets = buckets
        self._sender.rebuild(self._buckets, self._before_send)
        self._launch_in_backward = self._sender.overlap
        self._control.plan(self._buckets)
        names = {id(p): name for name, p in trainable}
        self._slots = {}
        self._bucket_slots = []
        self._in_place = {}
        self._unscaled = [[] for _ in self._buckets]
        for bucket in self._buckets:
            slots = []
            for param, view in zip(bucket.params, bucket.views):
                in_place = view.numel() * view.element_size() <= IN_PLACE_BYTES
                slot = GradSlot(bucket=bucket.index, view=view, name=names[id(param)], in_place=in_place)
                self._slots[id(param)] = slot
                slots.append(slot)
                if in_place:
                    self._in_place.setdefault(param.device, []).append((param, slot))
                if param.grad is not None:  # None stays None: DDP's mark of an unused parameter
                    if param.grad.is_sparse:  # from a backward before the buckets: it stays sparse for the optimizer
                        self._sparse[id(param)] = (param, param.grad.sparse_dim())
                    adopt_grad(param, view)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
            self._bucket_slots.append(slots)
        self._all_slots = [slot for slots in self._bucket_slots for slot in slots]
        for _, param in self.named:
            if not param.requires_grad and param.is_floating_point():
                self._hooks.append(watch_frozen(param, self._on_new_trainable))
        self._learning = True
        self._reset_reduction()

    # -- backward passes ----------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        # Autograd runs hooks of parameters on different devices on its device threads at
        # once (DDP's reducer holds its mutex_ here too): the counts below are shared.
        with self._lock:
            if self._phase is not Phase.PASS:
                self._open_pass()
                if self._views_free and self._pass_reduces:
                    # Only this device's: autograd accumulates another device's gradients on another thread.
                    self._views_free = False
                    hand_views(self._in_place.get(param.device, ()))
            slot = self._slots[id(param)]
            if param.grad.is_sparse and id(param) not in self._sparse:
                self._sparse[id(param)] = (param, param.grad.sparse_dim())
            slot.land(
                param,
                self._pass_id,
                learning=self._learning,
                reduces=self._pass_reduces,
                launched=slot.bucket < self._next_launch,
                scale=self._scale,
            )
            if self._pass_reduces and not self._learning and slot.count == slot.expected:
                self._pending[slot.bucket] -= 1
                # Bucket 0 launches here whatever the runner: its agreement takes its place in the order of the
                # optimizer's communicator now, before any collective the script starts later in backward.
                if self._pending[slot.bucket] == 0 and (self._launch_in_backward or self._next_launch == 0):
                    self._launch_ready()

    def _on_new_trainable(self, param: torch.nn.Parameter) -> None:
        # A parameter frozen when the buckets were built got a gradient: every rank
        # learns it from the last bucket's control numbers and rebuilds the buckets.
        with self._lock:
            if self._phase is not Phase.PASS:
                self._open_pass()
            self._saw_new_trainable = True

    def _open_pass(self) -> None:
        # A pass after a reduction and no zero_grad (GradScaler skipped the step, a second
        # loss): the gradients accumulate onto the averaged ones and the next reduction
        # averages the sum, avg(old) + avg(new), as DDP does.
        if self._phase is Phase.REFUSED:
            # On every rank alike (each refused the step), before any of this pass's collectives.
            raise StepStoppedError(f"{self._refusal} (backward() before that zero_grad())")
        self._open_window()
        self._phase = Phase.PASS
        self._pass_id += 1
        self._pass_reduces = self._sync and self._passes_since_reduce + 1 >= self.backward_passes_per_step
        self.times.backward_start = time.perf_counter()
        pass_id = self._pass_id
        at_end_of_backward(self._end_pass, lambda: self._phase is Phase.PASS and self._pass_id == pass_id)

    def _end_pass(self) -> None:
        with self._lock:
            self._phase = Phase.IDLE
            self._passes_since_reduce += 1
            self._learning = False
            self.times.backward_end = time.perf_counter()
            if self._pass_reduces:
                self._launch_all()
                self._finish(self.times.backward_end)

    def _open_window(self) -> None:
        """Note which parameters have a gradient before the reduction's first pass writes any."""
        if self._passes_since_reduce == 0:  # no pass since the last reduction or zero_grad
            note_grads_present(self._buckets, self._bucket_slots)

    # -- launching -----------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        """Launch the buckets whose gradients are all ready, strictly in index order.

        So every rank issues the same sequence of collectives, whatever order its gradients arrive in.
        """
        buckets, pending = self._buckets, self._pending
        first = stop = self._next_launch
        while stop < len(buckets) and pending[stop] == 0:
            stop += 1
        if stop == first:
            return
        times, step, channel = self.times, self.steps_taken, self._channel
        if first == 0:
            times.begin(len(buckets))
        self._views_free = False
        now = time.perf_counter()
        labels = []
        for index in range(first, stop):
            times.bucket_launch[index] = now
            unscaled = fill_bucket(buckets[index], self._bucket_slots[index])
            self._unscaled[index] = unscaled if self._scale is not None else []
            labels.append(f"bucket {index} of step {step}{self._owner}")
        if stop == len(buckets):  # the last bucket: its counters and control numbers describe the whole pass
            last = buckets[-1]
            write_used(last, self._all_slots)
            self._control.write(last.control, self.has_data, self._saw_new_trainable)
        # Where optimizers share a gloo group, each bucket is agreed on just before it starts; else bucket 0 only.
        each = channel is not None and channel.agrees_each_bucket
        for part in range(first, stop) if each else (first,):
            end = part + 1 if each else stop
            if channel is not None and (part == 0 or each):
                started = time.perf_counter()
                bucket = buckets[part]
                channel.before_bucket(
                    part, bucket.buffer if bucket.wire is None else bucket.wire, label=labels[part - first], step=step
                )
                # gloo waits here for the other ranks inside backward: the step's reports count it as wait
                if self._phase is Phase.PASS:
                    times.launch_waited(started)
            submitted = time.perf_counter()
            times.bucket_submit[part:end] = [submitted] * (end - part)
            try:
                self._sender.start(
                    part,
                    end,
                    self.num_reductions,
                    labels=labels[part - first : end - first],
                    step=step,
                    into=self._handles,
                )
            finally:
                self._next_launch = len(self._handles)

    def _launch_all(self) -> None:
        """Launch every bucket not yet launched; unused parameters count as zero."""
        self._phase = Phase.LAUNCHED
        for index in range(self._next_launch, len(self._buckets)):
            self._pending[index] = 0
        self._launch_ready()
        self._passes_since_reduce = 0

    def _before_send(self, first: int, stop: int) -> None:
        """Ready buckets ``first`` to ``stop - 1`` where they are sent, just before: scaled, probed, in one go."""
        # Scaled before the sum, as DDP does: it keeps fp16 sums in range.
        scaled, probed = [], []
        for bucket, unscaled in zip(self._buckets[first:stop], self._unscaled[first:stop]):
            if not unscaled or unscaled[0] is not bucket.grads:
                probed.append(bucket.sample)
            scaled += unscaled
        self._control.before_send(self._buckets[first:stop], scaled, probed)

    # -- finishing ------------------------------------------------------------------------------
    def _finish(self, started: float) -> None:
        """Wait for the launched buckets and turn the sums into the agreed averages.

        Args:
            started: when the wait began (the ``synchronize`` span of the timeline).
        """
        recorder = timeline.current() if self._record_timeline else None
        try:
            self._sender.wait(self._handles)
            copy_out_start = time.perf_counter()
            self._sender.copy_out(self._buckets)
            self.times.done(self._buckets, self._handles, copy_out_start, recorder, self.num_reductions)
            if self._channel is not None:
                self._confirm_step()
        except BaseException as err:
            self._stopped_part_way(err)
            raise
        changed, self.active_ranks, self.nonfinite_ranks, stopped = self._control.read(self._buckets[-1].control)
        if stopped:
            self._refuse_stopped_step(stopped)
        if self.nonfinite_ranks:
            self._sender.reset()
        elif not self.zero_unused:
            self._sender.keep_unapplied(self._buckets)
        self._postscale()
        if not self.zero_unused:
            drop_unused_grads(self._buckets)
        self.num_reductions += 1
        self._reset_reduction()
        self._phase = Phase.IDLE
        if changed:
            self._adopt_new_trainable()
        self.times.waited(started)
        if recorder is not None:
            recorder.span("synchronize", started, self.times.wait_end)
        if self._after_reduction is not None and self._channel is not None:
            # Here, and not in step(): every rank that completed this reduction comes here, in the
            # buckets' order on their communicator, however the script then steps.
            self._after_reduction(self.num_reductions, self.active_ranks, self._channel.comm)

    def _finish_abandoned(self) -> None:
        """Wait for a reduction nobody finished (an exception part-way), so no bucket is written while it is sent."""
        channel = self._channel
        if channel is not None and channel.refused_step():
            # Every rank refused the step alike; buckets launched before the refusal (gloo agrees
            # on each bucket where optimizers share a group) complete on every rank: not written while sent.
            for handle in self._handles:
                with contextlib.suppress(Exception):
                    handle.wait()
            return
        if channel is not None and channel.failed:
            return  # this rank is out of step: the others wait in buckets it never launched
        if channel is not None and self._next_launch < len(self._buckets):
            if self._sender.compressor is not None:
                self._stopped_part_way(None)  # the other ranks wait in collectives this rank never started
                return
            # The other ranks wait in buckets this rank never launched.
            self._send_rest_stopped()
            return
        for handle in self._handles:
            handle.wait()

    def _send_rest_stopped(self, *, raise_refusal: bool = False) -> None:
        """Send the step's buckets not yet launched, saying in the control numbers that this rank stopped.

        Every rank then refuses the step alike (``StepStoppedError``, Phase.REFUSED). At
        ``zero_grad()`` this rank raised its own error when it stopped, so it does not raise
        again (``raise_refusal`` False); at ``step()`` it raises with the others.
        """
        self._control.stopped = True
        self._launch_all()
        try:
            self._finish(time.perf_counter())
        except StepStoppedError:
            if raise_refusal:
                raise

    def _refuse_unfinished_pass(self) -> None:
        """Refuse to reduce a backward pass that raised part-way: its gradients are partial.

        Autograd reports the end of every pass it completes before ``backward()`` returns
        (``at_end_of_backward``), so a pass still open here was left by an exception the
        script caught. Its buckets go out marked stopped, and every rank raises
        ``StepStoppedError`` with the step's gradients dropped, as when ``zero_grad()``
        follows such a pass. With compression the stop cannot ride in the buckets: this
        rank raises alone; ``zero_grad()`` and the batch again then continue exactly when
        no bucket had left, else this rank is out of step (as at ``zero_grad()``).
        """
        if self._sender.compressor is not None:
            if self._handles:  # the others wait in buckets this rank will never complete
                self._stopped_part_way(None)
            raise RuntimeError(
                f"step() after a backward pass that raised part-way (step {self.steps_taken}{self._owner}): its "
                "gradients are partial and would be averaged with the other ranks' full ones; call zero_grad() and "
                "run the batch again"
            )
        self._send_rest_stopped(raise_refusal=True)

    def _confirm_step(self) -> None:
        """Raise on every rank, the step's sums dropped, when its agreement (read after the buckets on GPUs) failed."""
        try:
            self._channel.confirm_step()
        except CollectiveMismatchError:
            reset_grads(self._buckets, True)  # summed with another step's or optimizer's: never applied
            self._sender.reset()  # nor kept in the compression memory
            raise

    def _refuse_stopped_step(self, stopped: list[int]) -> None:
        """Some rank's backward stopped part-way: drop this step's sums on every rank and raise."""
        reset_grads(self._buckets, True)
        self._reset_reduction()
        # Until zero_grad(), step(), synchronize() and backward() raise this again: a rank that stepped
        # on the dropped gradients would be a step ahead of the others at the retry.
        self._phase = Phase.REFUSED
        self._refusal = (
            f"gradient reduction of step {self.steps_taken}{self._owner}: {ranks_text(stopped)} stopped part-way "
            "through its backward pass (an exception it caught) and sent the rest of the step only to keep the ranks "
            "in step: this step's gradients were dropped on every rank (None); zero_grad() and run the batch again"
        )
        raise StepStoppedError(self._refusal)

    def _stopped_part_way(self, err: BaseException | None) -> None:
        """This rank's reduction failed or was left part-way: unless every rank refused the step, it is out of step."""
        channel = self._channel
        if channel is None or channel.refused_step():
            return
        if err is not None and self._sender.compressor is None and self._next_launch == len(self._buckets):
            return  # every bucket was sent: the step completes on every rank, whatever failed here after
        what = "was left part-way" if err is None else f"failed on this rank ({type(err).__name__}: {err})"
        channel.fail(
            f"the gradient reduction of step {self.steps_taken}{self._owner} {what} after its buckets began, so "
            f"this rank's gradient collectives are out of step with the other ranks' (which wait in that step; "
            "the stall inspector names them): an error during backward must end the job or happen on every rank"
        )

    def _postscale(self) -> None:
        if self._op is not ReduceOp.AVERAGE:
            return
        # hpcddp.join(): joined ranks sent zeros, so the average is over the ranks that still had data.
        active = self.divide_by_active and 0 < self.active_ranks < self.comm.size
        factor = self._predivide / (self.active_ranks if active else self.comm.size)
        if factor != 1.0:
            for bucket in self._buckets:
                bucket.grads.mul_(factor)

    def _reset_reduction(self) -> None:
        self._views_free = False
        self._sender.abandon()
        self._handles.clear()
        for slot in self._slots.values():
            slot.used = False
            slot.scaled = False
        # The last bucket waits for the end of the pass: its control numbers describe the whole pass.
        self._pending = [len(b.params) for b in self._buckets]
        if self._pending:
            self._pending[-1] += 1
        self._next_launch = 0
        self._control.reset()
        self._saw_new_trainable = False

    def _adopt_new_trainable(self) -> None:
        """Average the gradients of parameters that became trainable, then rebuild the buckets.

        Collective: every rank gets here after the same reduction.
        """
        trainable = self._trainable()
        check_same_parameters(self.comm, trainable, "DistributedOptimizer (after requires_grad changed)")
        added = [(name, p) for name, p in trainable if id(p) not in self._slots]
        average_loose_grads([p for _, p in added], self.comm, self._op, zero_unused=self.zero_unused)
        log.info("hpcddp: %d parameter(s) became trainable (%s...), rebuilding buckets", len(added), added[0][0])
        self._build(trainable)
