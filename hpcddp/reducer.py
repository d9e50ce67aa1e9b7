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
- the last bucket carries a few control numbers along with the gradients: how many
  ranks still have data (join), whether a rank saw a parameter become trainable,
  and which ranks had a non-finite local gradient. No extra collective per step.
  They travel in the bucket's dtype, so every number is a sum of at most 256 ones
  (bf16 counts exactly to 256): ranks are counted in groups of 256.

States of one reduction (changed only under ``_lock``: autograd may run the hooks of
parameters on different devices on its device threads at once):

- IDLE: no pass open, nothing launched. A gradient hook (or a frozen parameter's
  first gradient) opens a pass -> PASS. ``_pass_reduces`` is fixed then: not inside
  ``no_sync()``, and this pass completes ``backward_passes_per_step`` passes.
- PASS: each gradient lands in its bucket view. In a reducing pass after the first
  (``_learning`` off), a parameter's last expected accumulation lowers its bucket's
  pending count, and buckets whose count reaches zero are launched strictly in index
  order (``_next_launch``); the last bucket waits for the end of the pass. Autograd's
  end-of-pass callback (the outer backward's, for reentrant checkpoints) launches the
  rest -> LAUNCHED, or -> IDLE for a pass that only accumulates.
- LAUNCHED: ``_finish`` waits for every bucket, reads the control numbers, scales
  -> IDLE with ``num_reductions`` + 1 (and rebuilt buckets when a parameter became
  trainable on some rank). ``synchronize()`` and ``zero_grad()`` finish a launched
  reduction from wherever they are called, so a bucket is never written while its
  reduction runs.

Every rank therefore launches the same buckets in the same order, each tagged with the
optimizer's step, which the ranks compare before reducing it (``hpcddp.comm.engine``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import Variable

from . import timeline
from ._autograd import queue_on_outer_backward
from ._consistency import check_same_parameters
from ._trainable import average_loose_grads, watch_frozen
from .buckets import MB, Bucket, adopt_grad, build_buckets, drop_unused_grads, probe_nonfinite
from .comm.base import Communicator, Handle, ReduceOp
from .stall import collective_tag

__all__ = ["ReductionTimes", "Reducer"]

log = logging.getLogger("hpcddp")

# Control numbers at the end of the last bucket (summed over ranks like the gradients):
# whether a parameter became trainable, then the ranks with data per group of 256 ranks,
# then one non-finite flag per rank.
_CHANGED, _ACTIVE = 0, 1
#: ranks counted in one control number: sums of ones stay exact in bf16 up to 256
_RANKS_PER_COUNT = 256


@dataclass
class _Slot:
    """Where one parameter's gradient lives, and what this reduction knows about it."""

    bucket: int
    view: torch.Tensor
    name: str
    #: got a gradient on this rank since the last reduction
    used: bool = False
    #: the view holds gradient / predivide (written so by the hook), not a raw sum
    scaled: bool = False
    #: the backward pass ``count`` belongs to, and the accumulations seen in it
    pass_id: int = -1
    count: int = 0
    #: accumulations per backward pass, learned (a weight used outside and inside a
    #: reentrant torch.utils.checkpoint accumulates twice)
    expected: int = 1


@dataclass
class ReductionTimes:
    """perf_counter timestamps of the last reduction, for overlap checks and timelines."""

    backward_start: float = 0.0
    backward_end: float = 0.0
    bucket_launch: list[float] = field(default_factory=list)
    #: when each bucket's buffer went to the backend (after predivide and compression)
    bucket_submit: list[float] = field(default_factory=list)
    bucket_done: list[float] = field(default_factory=list)


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
        predivide: gradients are divided by this before the sum and the sum
            multiplied by ``predivide / size`` after it (op AVERAGE).
        backward_passes_per_step: reduce once every this many backward passes.
        record_timeline: record bucket reductions in ``hpcddp.timeline``.
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
        backward_passes_per_step: int = 1,
        record_timeline: bool = False,
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
        self._op = op
        self._predivide = predivide
        self._lock = threading.RLock()
        self._bucket_args = (bucket_cap_bytes, first_bucket_bytes, wire_dtype)
        self._record_timeline = record_timeline
        self._sync = True
        self._pass_open = False
        self._pass_reduces = False
        self._pass_id = 0
        self._passes_since_reduce = 0
        self._learning = True
        self._saw_new_trainable = False
        self._handles: list[Handle] = []
        self._hooks: list[Any] = []
        self._buckets: list[Bucket] = []
        self._slots: dict[int, _Slot] = {}
        self._bucket_slots: list[list[_Slot]] = []
        self._pending: list[int] = []
        self._next_launch = 0
        self._local_sums: list[torch.Tensor] = []
        if comm.size > 1:
            trainable = self._trainable()
            if not trainable:
                # Unfreezing is noticed through the buckets' control numbers: some must exist.
                raise ValueError(
                    f"none of the {len(self.named)} parameters requires grad: set requires_grad=True on those "
                    "to train before building the DistributedOptimizer"
                )
            check_same_parameters(comm, trainable, "DistributedOptimizer")
            self._build(trainable)

    # -- public ---------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (empty in a world of one)."""
        return self._buckets

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
        if self._pass_open:  # a pass whose end autograd never reported (see _close_pass)
            self._end_pass()
        started = time.perf_counter()
        if not self._handles and (force or self._passes_since_reduce > 0):
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
            # A reduction nobody waited for: finish it so the buffers are not
            # written while the communication thread reads them.
            for handle in self._handles:
                handle.wait()
            self._reset_reduction()
        for slot in self._slots.values():
            slot.used = False
            slot.scaled = False
        for bucket in self._buckets:
            if set_to_none:
                for param in bucket.params:
                    param.grad = None
                continue
            bucket.grads.zero_()
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not view:
                    param.grad = view
        self._passes_since_reduce = 0

    def close(self) -> None:
        """Remove the hooks: the parameters' gradients stay local from now on."""
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
        self.close()
        cap, first, wire_dtype = self._bucket_args
        self._nonfinite_at = _ACTIVE + -(-self.comm.size // _RANKS_PER_COUNT)
        control_size = self._nonfinite_at + self.comm.size
        self._buckets = build_buckets([p for _, p in trainable], cap, first, wire_dtype, control_size)
        names = {id(p): name for name, p in trainable}
        self._slots = {}
        self._bucket_slots = []
        for bucket in self._buckets:
            slots = []
            for param, view in zip(bucket.params, bucket.views):
                slot = _Slot(bucket=bucket.index, view=view, name=names[id(param)])
                self._slots[id(param)] = slot
                slots.append(slot)
                if param.grad is not None:  # None stays None: DDP's mark of an unused parameter
                    adopt_grad(param, view)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))
            self._bucket_slots.append(slots)
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
            self._count_ready(param)

    def _count_ready(self, param: torch.nn.Parameter) -> None:
        if not self._pass_open:
            self._open_pass()
        slot = self._slots[id(param)]
        if slot.pass_id != self._pass_id:
            slot.pass_id, slot.count = self._pass_id, 0
        slot.count += 1
        slot.used = True
        if self._learning:
            slot.expected = max(slot.expected, slot.count)
        if not self._pass_reduces:
            adopt_grad(param, slot.view)  # accumulate locally, in the bucket
            return
        if slot.bucket < self._next_launch or (slot.count > slot.expected and slot.scaled):
            raise RuntimeError(
                f"parameter {slot.name!r} received gradient #{slot.count} of one backward pass, more than the "
                f"{slot.expected} of the first pass, after its share was reduced or scaled: its gradient "
                "would be wrong. A parameter used more often in one backward pass than in the first (reentrant "
                "torch.utils.checkpoint, a layer reused a varying number of times) cannot be reduced while "
                "backward runs: use torch.utils.checkpoint(..., use_reentrant=False), or use it equally often "
                "in every pass"
            )
        if slot.count > slot.expected:  # a raw sum in a bucket not yet sent: still right
            slot.expected = slot.count
        grad = param.grad
        if grad is not slot.view and grad.is_sparse:  # nn.Embedding(sparse=True): reduced dense
            grad = grad.to_dense()
        if grad is not slot.view:
            if self._learning or slot.expected > 1 or self._op is not ReduceOp.AVERAGE:
                # Several accumulations may land in the view: keep it a raw sum, divided at launch.
                adopt_grad(param, slot.view)
            else:
                # A fresh gradient: divide it on its way into the bucket, which spares
                # a separate pass over the buffer at launch.
                torch.div(grad, self._predivide, out=slot.view)
                param.grad = slot.view
                slot.scaled = True
        if self._learning:
            return
        if slot.count == slot.expected:
            self._pending[slot.bucket] -= 1
            if self._pending[slot.bucket] == 0:
                self._launch_ready()

    def _on_new_trainable(self, param: torch.nn.Parameter) -> None:
        # A parameter frozen when the buckets were built got a gradient: every rank
        # learns it from the last bucket's control numbers and rebuilds the buckets.
        with self._lock:
            if not self._pass_open:
                self._open_pass()
            self._saw_new_trainable = True

    def _open_pass(self) -> None:
        # A pass after a reduction and no zero_grad (GradScaler skipped the step, a second
        # loss): the gradients accumulate onto the averaged ones and the next reduction
        # averages the sum, avg(old) + avg(new), as DDP does.
        self._pass_open = True
        self._pass_id += 1
        self._pass_reduces = self._sync and self._passes_since_reduce + 1 >= self.backward_passes_per_step
        self.times.backward_start = time.perf_counter()
        Variable._execution_engine.queue_callback(self._close_pass)

    def _close_pass(self) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            # The pass opened inside a reentrant backward (torch.utils.checkpoint with
            # use_reentrant=True), whose end is not the end of the outer backward:
            # close when the outer one ends instead.
            pass_id = self._pass_id
            if not queue_on_outer_backward(
                node, self._close_pass, lambda: self._pass_open and self._pass_id == pass_id
            ):
                self._end_pass()
            return
        self._end_pass()

    def _end_pass(self) -> None:
        with self._lock:
            self._end_pass_locked()

    def _end_pass_locked(self) -> None:
        self._pass_open = False
        self._passes_since_reduce += 1
        self._learning = False
        self.times.backward_end = time.perf_counter()
        if self._pass_reduces:
            self._launch_all()
            self._finish(self.times.backward_end)

    # -- launching -----------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        # Buckets start strictly in index order so every rank issues the same
        # sequence of collectives, whatever order its gradients arrive in.
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch_all(self) -> None:
        """Launch every bucket not yet launched; unused parameters count as zero."""
        for index in range(self._next_launch, len(self._buckets)):
            self._pending[index] = 0
        self._launch_ready()
        self._passes_since_reduce = 0

    def _launch(self, bucket: Bucket) -> None:
        index = bucket.index
        if index == 0 or len(self.times.bucket_launch) != len(self._buckets):
            self.times.bucket_launch = [0.0] * len(self._buckets)
            self.times.bucket_submit = [0.0] * len(self._buckets)
            self.times.bucket_done = [0.0] * len(self._buckets)
        self.times.bucket_launch[index] = time.perf_counter()
        used, unscaled = [], []
        for param, slot in zip(bucket.params, self._bucket_slots[index]):
            if not slot.scaled:
                adopt_grad(param, slot.view)
                unscaled.append(slot.view)
            used.append(slot.used)
        if self._op is ReduceOp.AVERAGE and self._predivide != 1.0 and unscaled:
            # Divide before summing, as DDP does: it keeps fp16 sums in range.
            if len(unscaled) == len(bucket.views):
                bucket.grads.div_(self._predivide)
            else:
                for view in unscaled:
                    view.div_(self._predivide)
        bucket.used.copy_(torch.tensor(used, dtype=bucket.used.dtype))
        self._local_sums[index] = probe_nonfinite(bucket.grads)
        if bucket.control is not None:
            self._write_control(bucket.control)
        payload = bucket.buffer if bucket.wire is None else bucket.wire.copy_(bucket.buffer)
        with collective_tag(f"bucket {index} of step {self.steps_taken}", self.steps_taken):
            self.times.bucket_submit[index] = time.perf_counter()
            self._handles.append(self.comm.allreduce_async_(payload, ReduceOp.SUM))

    def _write_control(self, control: torch.Tensor) -> None:
        control.zero_()
        control[_ACTIVE + self.comm.rank // _RANKS_PER_COUNT] = 1.0 if self.has_data else 0.0
        control[_CHANGED] = 1.0 if self._saw_new_trainable else 0.0
        sums = torch.stack([s.to(control.device) for s in self._local_sums])
        control[self._nonfinite_at + self.comm.rank] = torch.isfinite(sums).all().logical_not()

    # -- finishing ------------------------------------------------------------------------------
    def _finish(self, started: float) -> None:
        """Wait for the launched buckets and turn the sums into the agreed averages.

        Args:
            started: when the wait began (the ``synchronize`` span of the timeline).
        """
        recorder = timeline.current() if self._record_timeline else None
        for bucket, handle in zip(self._buckets, self._handles):
            handle.wait()
            copy_out_start = time.perf_counter()
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)
            # When the backend finished it, not when we looked: that shows the overlap.
            self.times.bucket_done[bucket.index] = handle.completed_at or copy_out_start
            if recorder is not None:
                recorder.bucket_reduction(
                    bucket.index,
                    self.times.bucket_launch[bucket.index],
                    self.times.bucket_submit[bucket.index],
                    handle,
                    (copy_out_start, time.perf_counter()),
                    step=self.num_reductions,
                    mib=round(bucket.nbytes / MB, 3),
                )
        control = self._buckets[-1].control.tolist()
        self.active_ranks = sum(round(count) for count in control[_ACTIVE : self._nonfinite_at])
        self.nonfinite_ranks = [r for r, flag in enumerate(control[self._nonfinite_at :]) if flag]
        self._postscale()
        if self.set_to_none and not self.zero_unused:
            for bucket in self._buckets:
                drop_unused_grads(bucket)
        self.num_reductions += 1
        self._reset_reduction()
        if control[_CHANGED]:
            self._adopt_new_trainable()
        if recorder is not None:
            recorder.span("synchronize", started, time.perf_counter())

    def _postscale(self) -> None:
        if self._op is not ReduceOp.AVERAGE:
            return
        divisor = self.comm.size
        # hpcddp.join(): joined ranks sent zeros, so the average is over the ranks
        # that still had data in this step.
        if self.divide_by_active and 0 < self.active_ranks < divisor:
            divisor = self.active_ranks
        factor = self._predivide / divisor
        if factor != 1.0:
            for bucket in self._buckets:
                bucket.grads.mul_(factor)

    def _reset_reduction(self) -> None:
        self._handles.clear()
        for slot in self._slots.values():
            slot.used = False
            slot.scaled = False
        # The last bucket waits for the end of the pass: its control numbers must
        # describe the whole pass.
        self._pending = [len(b.params) for b in self._buckets]
        if self._pending:
            self._pending[-1] += 1
        self._next_launch = 0
        self._local_sums = [torch.zeros(())] * len(self._buckets)
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
