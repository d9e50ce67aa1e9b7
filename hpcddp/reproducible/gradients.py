"""ExactGradientMean: every backward pass a micro-batch, summed exactly; the mean over all ranks at the step."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..comm.base import Communicator, ReduceOp
from ..ddp.autograd_hooks import at_end_of_backward
from ..ddp.consistency import check_same_parameters
from ..ddp.reducer import StepStoppedError
from . import fixed_point

__all__ = ["ExactGradientMean", "Reduction"]

# Rows of the per-parameter flags reduced with MAX at each step.
_GOT_GRADIENT, _NONFINITE, _ASSIGNED = range(3)
# Then one number each for the whole rank, in this order.
_STOPPED_RANK, _TOO_MANY, _BYPASSED, _MOST_MICRO_BATCHES = range(4)


@dataclass(frozen=True)
class Reduction:
    """What ``reduce()`` did: the same on every rank."""

    #: micro-batches summed over all ranks (0: the gradients were left as they were)
    num_micro_batches: int
    #: names of the parameters whose gradient was inf or NaN in some micro-batch (their grad is NaN)
    nonfinite: list[str]


class ExactGradientMean:
    """Take each backward pass's gradients into an exact sum; at ``reduce()`` set ``grad`` to the mean over all ranks.

    A backward pass that gives any of ``named`` a gradient is one micro-batch. As each
    gradient is accumulated it moves into digit sums (``fixed_point``) and ``grad``
    becomes None. ``reduce()`` (collective) agrees on each parameter's digit position
    and on what went wrong anywhere (one MAX allreduce of int32, 4 per parameter), sums
    the digits and the micro-batch counts (one SUM allreduce, of float64 while that is exact, else
    of int64), and sets each
    ``grad`` to the sum divided by the number of micro-batches of all ranks. The result
    depends only on the multiset of micro-batch gradients: not on the world size, nor on
    which rank ran which.

    A gradient left in ``grad`` by the last ``reduce()`` (no ``zero_grad``, or one
    zeroed in place) is added to the mean, as torch adds to it. Problems found on any
    rank raise on every rank, at ``reduce()``: a gradient assigned by hand
    (RuntimeError), a backward pass that raised part-way (``StepStoppedError``), hooks
    that torch bypassed (the parameters were moved or cast after the optimizer was
    built: RuntimeError). A non-finite micro-batch gradient is reported in the result.

    Args:
        named: (name, parameter) pairs, the same on every rank.
        communicator: the ranks to average over.
        average: divide by the number of micro-batches (False: their sum).
    """

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], communicator: Communicator, *, average: bool):
        params = [p for _, p in named]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"reproducible=True needs every parameter on one device, got {sorted(map(str, devices))}: "
                "wrap one optimizer per device"
            )
        self.named = list(named)
        self.comm = communicator
        self.average = average
        check_same_parameters(communicator, self.named, "DistributedOptimizer(reproducible=True)")
        num_digits = fixed_point.digits_needed({p.dtype for p in params})
        self._offsets = [0]
        for param in params:
            self._offsets.append(self._offsets[-1] + param.numel())
        numel, device, num_params = self._offsets[-1], params[0].device, len(params)
        largest = max(p.numel() for p in params)
        # Scratch for one parameter's gradient in float64 (no allocation per pass).
        self._values = torch.empty(largest, dtype=torch.float64, device=device)
        self._rest = torch.empty(largest, dtype=torch.float64, device=device)
        # One buffer per collective, so that each goes in one message without a copy: the digit sums
        # (float64 while this rank adds, int64 for the sum across ranks) and, last, this rank's
        # micro-batch count; each parameter's digit position and flags, then the rank's own numbers.
        self._sums = torch.zeros(num_digits * numel + 1, dtype=torch.int64, device=device)
        self._digits = self._sums[:-1].view(torch.float64).view(num_digits, numel)
        self._agreed = torch.zeros(4 * num_params + 4, dtype=torch.int32, device=device)
        self._flags = self._agreed[num_params : 4 * num_params].view(3, num_params)
        self._rank_numbers = self._agreed[4 * num_params :]
        #: each parameter's digit position on this rank (fixed_point.position_of its largest gradient)
        self._positions = [fixed_point.NO_DIGIT] * num_params
        #: micro-batches this rank summed since the last reduce()
        self.num_micro_batches = 0
        self._in_pass: list[int] = []
        self._pass_open = False
        self._dirty = False
        #: the grad each parameter held before this step's first backward pass reached it
        self._carried: dict[int, torch.Tensor] = {}
        #: the grad tensors the last step left, by parameter index (carried into the next, not "by hand")
        self._written: dict[int, torch.Tensor] = {}
        self._accumulators: list = []
        this = weakref.ref(self)  # the hooks must not keep an optimizer alive that the script dropped
        self._hooks = [handle for index, param in enumerate(params) for handle in _hook(this, index, param, self)]
        self.clear_()

    # -- each backward pass ----------------------------------------------------------------
    def _before_accumulate(self, index: int, param: torch.nn.Parameter) -> None:
        if not self._pass_open:
            self._open_pass()
        if param.grad is not None:
            # Set aside so that the pass brings only its own: the last step's grad is added at reduce();
            # any other was assigned by hand on this rank alone.
            if index not in self._carried and param.grad is self._written.get(index):
                self._carried[index] = param.grad
            else:
                self._flags[_ASSIGNED, index] = 1
            param.grad = None

    def _open_pass(self) -> None:
        self._pass_open = True
        self._dirty = True
        at_end_of_backward(self._end_pass, lambda: self._pass_open)

    def _after_accumulate(self, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if not self._pass_open or grad is None:
            # The pre-hook did not run (torch made a new accumulator: the parameter was moved or cast
            # after the optimizer was built), or another hook took the gradient first.
            self._rank_numbers[_BYPASSED] = 1
            self._dirty = True
            return
        param.grad = None
        self._in_pass.append(index)
        if grad.is_sparse:
            grad = grad.to_dense()
        if grad.numel() == 0:
            return
        grad = grad.detach()
        low, high = (float(v) for v in torch.aminmax(grad))
        largest = max(-low, high)
        if not math.isfinite(largest):
            self._flags[_NONFINITE, index] = 1
            return
        position = fixed_point.position_of(largest)
        if position == fixed_point.NO_DIGIT:
            return
        self._raise_position(index, position)
        numel = grad.numel()
        digits = self._param_digits(index)
        fixed_point.add_(digits, self._positions[index], grad, self._values[:numel], self._rest[:numel])

    def _param_digits(self, index: int) -> torch.Tensor:
        return self._digits[:, self._offsets[index] : self._offsets[index + 1]]

    def _raise_position(self, index: int, position: int) -> None:
        """Move parameter ``index``'s digits up to ``position`` if it is higher (its low digits drop)."""
        mine = self._positions[index]
        if position > mine:
            if mine != fixed_point.NO_DIGIT:  # nothing summed yet: nothing to move
                fixed_point.shift_down_(self._param_digits(index), position - mine)
            self._positions[index] = position

    def _end_pass(self) -> None:
        self._pass_open = False
        for index in self._in_pass:
            self._flags[_GOT_GRADIENT, index] = 1
        self._in_pass.clear()
        self.num_micro_batches += 1

    # -- the step --------------------------------------------------------------------------
    def reduce(self, *, expect_none: bool = False) -> Reduction:
        """Set every ``grad`` to the mean over all ranks' micro-batches since the last call (collective).

        With no micro-batch on any rank the gradients are left as they are, and only
        the small agreement is sent. A parameter whose gradient was inf or NaN in a
        micro-batch gets a NaN gradient and is named in the result.

        Args:
            expect_none: raise on every rank if any rank ran a micro-batch (``step()``
                after ``synchronize()``).

        Raises:
            StepStoppedError: on every rank, when a backward pass raised part-way on any rank.
            RuntimeError: on every rank, when a rank's gradient was assigned by hand, or
                its hooks were bypassed, or a micro-batch ran where none was expected.
            ValueError: on every rank, when too many micro-batches were summed.
        """
        try:
            self._check_local_state()
            num_params = len(self.named)
            self._agreed[:num_params] = torch.tensor(self._positions, dtype=torch.int32)
            self.comm.allreduce_(self._agreed, ReduceOp.MAX)
            self._raise_for_flags(expect_none)
            most = int(self._rank_numbers[_MOST_MICRO_BATCHES])
            if not most:
                return Reduction(0, [])
            for index, position in enumerate(self._agreed[:num_params].tolist()):
                self._raise_position(index, position)
            self._dirty = True  # the sums over all ranks land here, also on a rank that ran no micro-batch
            if most * self.comm.size <= fixed_point.MAX_LOCAL_CONTRIBUTIONS:  # float64 sums stay exact
                floats = self._sums.view(torch.float64)
                floats[-1] = self.num_micro_batches
                self.comm.allreduce_(floats, ReduceOp.SUM)
                return self._write_grads(int(floats[-1]))
            fixed_point.as_int64_(self._sums[:-1].view(torch.float64))
            self._sums[-1] = self.num_micro_batches
            self.comm.allreduce_(self._sums, ReduceOp.SUM)
            fixed_point.as_float64_(self._sums[:-1])
            return self._write_grads(int(self._sums[-1]))
        finally:
            self.clear_()

    def _check_local_state(self) -> None:
        numbers = self._rank_numbers
        if self._pass_open:  # its end-of-backward callback never ran: it raised part-way
            numbers[_STOPPED_RANK] = 1 + self.comm.rank
        if self.num_micro_batches > fixed_point.MAX_LOCAL_CONTRIBUTIONS:
            numbers[_TOO_MANY] = 1
        numbers[_MOST_MICRO_BATCHES] = min(self.num_micro_batches, 2**31 - 1)
        for index, (_, param) in enumerate(self.named):
            grad = param.grad
            if grad is None:
                continue
            if index in self._carried or grad is not self._written.get(index):
                self._flags[_ASSIGNED, index] = 1
            else:
                self._carried[index] = grad  # not reached by any pass here: the last step's grad, carried too

    def _raise_for_flags(self, expect_none: bool) -> None:
        numbers = self._rank_numbers.tolist()
        if numbers[_STOPPED_RANK]:
            raise StepStoppedError(
                f"a backward pass raised part-way on rank {numbers[_STOPPED_RANK] - 1}: every rank drops this "
                "step's gradients (reproducible=True); zero_grad() and run the step's micro-batches again"
            )
        if numbers[_BYPASSED]:
            raise RuntimeError(
                "hpcddp: a gradient reached a parameter without passing this optimizer's hooks on some rank, "
                "for one of two reasons: two DistributedOptimizer(reproducible=True) hold one parameter (give each "
                "its own parameters), or the model was moved or cast (model.to(...), .double()) after the optimizer "
                "was built (build it after moving the model)"
            )
        if numbers[_TOO_MANY]:
            raise ValueError(
                f"a rank ran more than {fixed_point.MAX_LOCAL_CONTRIBUTIONS} backward passes in one step, more "
                "than reproducible=True sums exactly per rank: take fewer micro-batches per step"
            )
        if expect_none and numbers[_MOST_MICRO_BATCHES]:
            raise RuntimeError(
                "a backward pass ran after synchronize() and before step() on some rank: its gradients would be "
                "left out; call synchronize() after the step's last backward pass"
            )
        flagged = self._flags[_ASSIGNED].nonzero().flatten().tolist()
        if flagged:
            names = ", ".join(repr(self.named[i][0]) for i in flagged[:3])
            more = f" and {len(flagged) - 3} more" if len(flagged) > 3 else ""
            raise RuntimeError(
                f"hpcddp: the gradient of {names}{more} was assigned by hand on some rank, not by backward(): "
                "reproducible=True averages only gradients from backward passes; compute it with loss.backward()"
            )

    def _write_grads(self, count: int) -> Reduction:
        if count > fixed_point.MAX_CONTRIBUTIONS:
            raise ValueError(
                f"a step summed {count} micro-batches, more than the {fixed_point.MAX_CONTRIBUTIONS} "
                "reproducible=True sums exactly: take fewer micro-batches per step"
            )
        got, nonfinite = self._flags[_GOT_GRADIENT].tolist(), self._flags[_NONFINITE].tolist()
        out_of_range = []
        for index, (name, param) in enumerate(self.named):
            carried = self._carried.get(index)
            if not (got[index] or nonfinite[index]):
                param.grad = carried
                continue
            values = fixed_point.to_float_(
                self._param_digits(index),
                self._positions[index],
                self._values[: param.numel()],
                count if self.average else 1,
            )
            if nonfinite[index]:
                values.fill_(math.nan)
            mean = values.view_as(param).to(param.dtype, copy=True)
            if not nonfinite[index] and param.numel() and not all(map(math.isfinite, torch.aminmax(mean))):
                out_of_range.append(name)
            param.grad = (
                mean if carried is None else carried.add_(mean) if carried.shape == mean.shape else carried + mean
            )
            self._written[index] = param.grad
        if out_of_range:  # the same values on every rank: every rank raises
            raise FloatingPointError(
                f"hpcddp: the {'mean' if self.average else 'sum'} gradient of {out_of_range[0]!r} does not fit its "
                f"dtype (the micro-batch gradients are finite): keep the parameter in a wider dtype"
            )
        return Reduction(count, [self.named[i][0] for i, bad in enumerate(nonfinite) if bad])

    def adopt_grads(self) -> None:
        """Take the gradients as they are now as the step's own (carried into the next, not "by hand")."""
        self._written = {i: p.grad for i, (_, p) in enumerate(self.named) if p.grad is not None}

    def clear_(self) -> None:
        """Drop what this rank summed since the last ``reduce()`` (a backward pass left open too)."""
        if self._dirty or self.num_micro_batches:
            self._digits.zero_()
        self._sums[-1] = 0
        self._agreed.zero_()
        self._positions = [fixed_point.NO_DIGIT] * len(self.named)
        self._carried.clear()
        self._in_pass.clear()
        self._pass_open = False
        self._dirty = False
        self.num_micro_batches = 0

    def zero_grad(self, set_to_none: bool) -> None:
        """Reset the gradients as torch's ``zero_grad`` does, and what was summed since the last step."""
        self.clear_()
        for index, (_, param) in enumerate(self.named):
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
                self._written.pop(index, None)
            else:
                param.grad.detach_().zero_()

    def close(self) -> None:
        """Remove the hooks (a pending sum is dropped)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._accumulators.clear()
        self.clear_()


def _hook(this: weakref.ref, index: int, param: torch.nn.Parameter, owner: ExactGradientMean) -> list:
    """Register the two hooks of ``param``, calling the ExactGradientMean ``this`` while it lives."""

    def before(grad_outputs) -> None:
        mean = this()
        if mean is not None:
            mean._before_accumulate(index, param)

    def after(tensor) -> None:
        mean = this()
        if mean is not None:
            mean._after_accumulate(index, tensor)

    frozen = not param.requires_grad
    # torch hooks only tensors that require grad; the hooks stay when that is switched off again.
    param.requires_grad_(True)
    try:
        # A pre-hook on the node that accumulates into grad, not on the tensor: it runs only when
        # backward() accumulates, not when torch.autograd.grad() computes the gradient.
        accumulator = param.view_as(param).grad_fn.next_functions[0][0]
        owner._accumulators.append(accumulator)  # torch holds it weakly
        return [accumulator.register_prehook(before), param.register_post_accumulate_grad_hook(after)]
    finally:
        param.requires_grad_(not frozen)
