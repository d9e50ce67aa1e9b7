"""ExactGradientMean: every backward pass a micro-batch, summed exactly; the mean over all ranks at the step."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ..comm.base import Communicator, ReduceOp
from ..ddp.autograd_hooks import at_end_of_backward
from ..ddp.consistency import check_same_parameters
from ..ddp.reducer import StepStoppedError
from . import fixed_point

__all__ = ["ExactGradientMean"]

# Rows of the flags reduced with MAX at each step, one column per parameter.
_GOT_GRADIENT, _NONFINITE, _ASSIGNED = range(3)


class ExactGradientMean:
    """Take each backward pass's gradients into an exact sum; at ``reduce()`` set ``grad`` to the mean over all ranks.

    A backward pass that gives any of ``named`` a gradient is one micro-batch. As each
    gradient is accumulated it moves into integer digit sums (``fixed_point``) and
    ``grad`` becomes None. ``reduce()`` (collective) agrees on each parameter's digit
    position (one MAX allreduce of 4 bytes per parameter), sums the digits and the
    micro-batch counts (one SUM allreduce of int64), and sets each ``grad`` to the sum divided by
    the number of micro-batches of all ranks. The result depends only on the multiset
    of micro-batch gradients: not on the world size, nor on which rank ran which.

    A gradient still in ``grad`` from before the step's first backward pass (the last
    step's, when ``zero_grad`` was not called) is added to the mean, as torch adds
    to it. Problems found on any rank raise on every rank, at ``reduce()``: a
    non-finite gradient (``FloatingPointError``), a gradient assigned by hand
    (RuntimeError), a backward pass that raised part-way (``StepStoppedError``).

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
        numel, device = self._offsets[-1], params[0].device
        largest = max(p.numel() for p in params)
        # Scratch for one parameter's gradient in float64 and its digits one at a time (no allocation per pass).
        self._values = torch.empty(largest, dtype=torch.float64, device=device)
        self._whole = torch.empty(largest, dtype=torch.int64, device=device)
        # One buffer per collective, so that each goes in one message without a copy: the digit sums and,
        # last, this rank's micro-batch count; each parameter's digit position, the flags, a stop mark.
        self._sums = torch.zeros(num_digits * numel + 1, dtype=torch.int64, device=device)
        self._digits = self._sums[:-1].view(num_digits, numel)
        self._agreed = torch.zeros(4 * len(params) + 1, dtype=torch.int8, device=device)
        self._flags = self._agreed[len(params) : -1].view(3, len(params))
        self._stopped_rank = self._agreed[-1:]  # 1 + the rank whose backward pass raised part-way, or 0
        #: each parameter's digit position on this rank (fixed_point.position_of its largest gradient)
        self._positions = [fixed_point.NO_DIGIT] * len(params)
        #: micro-batches this rank summed since the last reduce()
        self.num_micro_batches = 0
        self._in_pass: list[int] = []
        self._pass_open = False
        #: the grad each parameter held before this step's first backward pass reached it
        self._carried: dict[int, torch.Tensor] = {}
        #: the grad tensors reduce() wrote last, by parameter index
        self._written: dict[int, torch.Tensor] = {}
        self._accumulators: list = []
        self._hooks = [handle for index, param in enumerate(params) for handle in self._hook(index, param)]
        self._clear()

    # -- each backward pass ----------------------------------------------------------------
    def _hook(self, index: int, param: torch.nn.Parameter) -> list:
        frozen = not param.requires_grad
        # torch hooks only tensors that require grad; the hooks stay when that is switched off again.
        param.requires_grad_(True)
        try:
            # A pre-hook on the node that accumulates into grad, not on the tensor: it runs only when
            # backward() accumulates, not when torch.autograd.grad() computes the gradient.
            accumulator = param.view_as(param).grad_fn.next_functions[0][0]
            self._accumulators.append(accumulator)  # torch holds it weakly
            return [
                accumulator.register_prehook(functools.partial(self._before_accumulate, index, param)),
                param.register_post_accumulate_grad_hook(functools.partial(self._after_accumulate, index)),
            ]
        finally:
            param.requires_grad_(not frozen)

    def _before_accumulate(self, index: int, param: torch.nn.Parameter, grad_outputs) -> None:
        if not self._pass_open:
            self._pass_open = True
            at_end_of_backward(self._end_pass, lambda: self._pass_open)
        if param.grad is not None:
            # What grad held before this step: kept aside (added at reduce) so the pass brings only its own.
            self._carried.setdefault(index, param.grad)
            param.grad = None

    def _after_accumulate(self, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        self._in_pass.append(index)
        if grad.is_sparse:
            grad = grad.to_dense()
        if grad.numel() == 0:
            return
        low, high = (float(v) for v in torch.aminmax(grad.detach()))
        largest = max(-low, high)
        if not math.isfinite(largest):
            self._flags[_NONFINITE, index] = 1
            return
        position = fixed_point.position_of(largest)
        if position == fixed_point.NO_DIGIT:
            return
        digits = self._param_digits(index)
        if position > self._positions[index]:
            if self._positions[index] != fixed_point.NO_DIGIT:
                fixed_point.shift_down_(digits, position - self._positions[index])
            self._positions[index] = position
        numel = grad.numel()
        values = self._values[:numel]
        values.copy_(grad.reshape(-1))
        fixed_point.add_(digits, self._positions[index], values, self._whole[:numel])

    def _param_digits(self, index: int) -> torch.Tensor:
        return self._digits[:, self._offsets[index] : self._offsets[index + 1]]

    def _end_pass(self) -> None:
        self._pass_open = False
        for index in self._in_pass:
            self._flags[_GOT_GRADIENT, index] = 1
        self._in_pass.clear()
        self.num_micro_batches += 1

    # -- the step --------------------------------------------------------------------------
    def reduce(self) -> bool:
        """Set every ``grad`` to the mean over all ranks' micro-batches since the last call (collective).

        Returns False, with the gradients left untouched, when no rank ran a micro-batch.

        Raises:
            FloatingPointError: on every rank, when a micro-batch gradient on any rank was inf or NaN.
            StepStoppedError: on every rank, when a backward pass raised part-way on any rank.
            RuntimeError: on every rank, when a rank's gradient was assigned outside backward.
        """
        try:
            self._check_local_state()
            num_params = len(self.named)
            self._agreed[:num_params] = torch.tensor(self._positions, dtype=torch.int8)
            self.comm.allreduce_(self._agreed, ReduceOp.MAX)
            self._raise_for_flags()
            agreed = self._agreed[:num_params].tolist()
            for index, (mine, position) in enumerate(zip(self._positions, agreed)):
                if mine != fixed_point.NO_DIGIT:
                    fixed_point.shift_down_(self._param_digits(index), position - mine)
            self._positions = agreed
            self._sums[-1] = self.num_micro_batches
            self.comm.allreduce_(self._sums, ReduceOp.SUM)
            return self._write_grads(int(self._sums[-1]))
        finally:
            self._clear()

    def _check_local_state(self) -> None:
        if self._pass_open:  # its end-of-backward callback never ran: it raised part-way
            self._stopped_rank.fill_(1 + self.comm.rank)
        for index, (_, param) in enumerate(self.named):
            grad = param.grad
            if grad is None:
                continue
            if index in self._carried or grad is not self._written.get(index):
                self._flags[_ASSIGNED, index] = 1
            else:
                self._carried[index] = grad  # not reached by any pass here: the last step's grad, carried too

    def _raise_for_flags(self) -> None:
        stopped = int(self._stopped_rank)
        if stopped:
            raise StepStoppedError(
                f"a backward pass raised part-way on rank {stopped - 1}: every rank skips this step's gradients "
                "(reproducible=True); zero_grad() and run the step's micro-batches again"
            )
        for row, error, what in (
            (
                _NONFINITE,
                FloatingPointError,
                "was inf or NaN in a micro-batch: an exact sum cannot hold it; find why "
                "the loss is not finite, or pass skip_nonfinite=True to skip such steps",
            ),
            (
                _ASSIGNED,
                RuntimeError,
                "was assigned by hand, not by backward(): reproducible=True averages only "
                "gradients from backward passes; compute it with loss.backward()",
            ),
        ):
            flagged = self._flags[row].nonzero().flatten().tolist()
            if flagged:
                names = ", ".join(repr(self.named[i][0]) for i in flagged[:3])
                more = f" and {len(flagged) - 3} more" if len(flagged) > 3 else ""
                raise error(f"hpcddp: the gradient of {names}{more} on some rank {what}")

    def _write_grads(self, count: int) -> bool:
        if count == 0:
            return False
        if count > fixed_point.MAX_CONTRIBUTIONS:
            raise ValueError(
                f"a step summed {count} micro-batches, more than the {fixed_point.MAX_CONTRIBUTIONS} "
                "reproducible=True sums exactly: take fewer micro-batches per step"
            )
        got = self._flags[_GOT_GRADIENT].tolist()
        for index, (_, param) in enumerate(self.named):
            carried = self._carried.get(index)
            if not got[index]:
                param.grad = carried
                continue
            values = fixed_point.to_float_(
                self._param_digits(index),
                self._positions[index],
                self._values[: param.numel()],
                count if self.average else 1,
            )
            mean = values.view_as(param)
            if carried is not None:
                param.grad = carried.add_(mean) if carried.shape == param.shape else carried + mean
            else:
                param.grad = mean.to(param.dtype, copy=True)
            self._written[index] = param.grad
        return True

    def _clear(self) -> None:
        self._digits.zero_()
        self._agreed.zero_()
        self._positions = [fixed_point.NO_DIGIT] * len(self.named)
        self._carried.clear()
        self._in_pass.clear()
        self._pass_open = False
        self.num_micro_batches = 0

    def zero_grad(self, set_to_none: bool) -> None:
        """Reset the gradients as torch's ``zero_grad`` does (written ones are zeroed in place with False)."""
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
        self._clear()
