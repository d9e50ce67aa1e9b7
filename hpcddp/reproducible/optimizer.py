"""ReproducibleOptimizer: ``DistributedOptimizer(reproducible=True)``, the same bits at any world size."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch

from ..comm.base import Communicator, ReduceOp
from ..ddp.optimizer import DistributedOptimizer
from ..ddp.optimizer_args import check_arguments, check_backward_passes, collect_parameters
from .gradients import ExactGradientMean, Reduction

__all__ = ["ReproducibleOptimizer"]

log = logging.getLogger("hpcddp")


class ReproducibleOptimizer(DistributedOptimizer):
    """A DistributedOptimizer whose step sees the exact mean over every micro-batch of every rank.

    Made by ``hpcddp.DistributedOptimizer(..., reproducible=True)``. Every backward
    pass before a ``step()`` is one micro-batch, whichever rank runs it and however
    many each rank runs (none too). Its gradients are summed exactly
    (``hpcddp.reproducible.fixed_point``), so ``step()`` hands the wrapped optimizer
    gradients that are the same in every bit at 1, 2, 3 or 512 ranks: the mean over
    all micro-batches of all ranks (op="sum": their sum). Do not divide the loss by
    the number of micro-batches yourself.

    Nothing is sent during backward; ``step()`` (or ``synchronize()``, to clip the
    gradients first) reduces, collectively: every rank calls it, also one that ran no
    micro-batch. Between a backward pass and that call ``p.grad`` is None.
    ``backward_passes_per_step`` and ``no_sync()`` are accepted and change nothing:
    every pass is summed, at the step. A non-finite micro-batch gradient on any rank
    raises FloatingPointError naming the parameter on every rank (with
    ``skip_nonfinite=True`` every rank skips the step instead).

    Parameters, data order and randomness must not depend on the rank either:
    ``hpcddp.reproducible.MicroBatchSampler`` hands each rank its micro-batches
    from one global order and seeds each by its global index.
    """

    _own_attributes = ("_optimizer", "reducer", "gradients")
    #: no bucketed Reducer: ``gradients`` holds the sums
    reducer = None
    reproducible = True
    # GradScaler.step() then passes itself to step(), which unscales the exact mean (see _scaled_step).
    _step_supports_amp_scaling = True
    _synchronized = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        backward_passes_per_step: int = 1,
        compression=None,
        op="average",
        *,
        communicator: Communicator | None = None,
        skip_nonfinite: bool = False,
        gradient_predivide_factor: float | None = None,
        reproducible: bool = True,
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
        if arguments.compressor is not None or arguments.wire_dtype is not None:
            raise ValueError(
                f"compression={compression!r} cannot be used with reproducible=True: lossy compression and an "
                "exact sum do not mix; pass compression=None"
            )
        if gradient_predivide_factor is not None:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor!r} cannot be used with reproducible=True, "
                "whose sum cannot overflow: drop it"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "reproducible=True cannot wrap torch.optim.LBFGS, whose step() runs the closure again and again: "
                "its backward passes cannot be summed once per step; use another optimizer or reproducible=False"
            )
        self._optimizer = optimizer
        if communicator is None:
            from ..runtime.state import communicator as current

            communicator = current()
            _warn_if_threads_follow_the_world_size()
        self._backward_passes = backward_passes_per_step
        #: the exact sums of the micro-batch gradients
        self.gradients = ExactGradientMean(
            collect_parameters(optimizer, named_parameters), communicator, average=arguments.op is ReduceOp.AVERAGE
        )
        self.skip_nonfinite = bool(skip_nonfinite)
        #: steps skipped because a micro-batch gradient was inf or NaN (skip_nonfinite)
        self.skipped_steps = 0

    def rebind_(self, communicator: Communicator) -> None:
        """Reduce over ``communicator`` from now on (collective on its ranks); a pending sum is dropped.

        Args:
            communicator: the new communicator.
        """
        old = self.gradients
        old.close()
        self.gradients = ExactGradientMean(old.named, communicator, average=old.average)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, reproducible=True)"

    @property
    def buckets(self) -> list:
        """Empty: the exact sums travel in one message per step, not in buckets."""
        return []

    @property
    def parameter_names(self) -> list[str]:
        """Names of the reduced parameters, in registration order."""
        return [name for name, _ in self.gradients.named]

    @property
    def times(self):
        """None: there are no bucket timestamps."""
        return None

    @property
    def backward_passes_per_step(self) -> int:
        """Accepted for compatibility; every backward pass is summed, at the step."""
        return self._backward_passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        check_backward_passes(passes)
        self._backward_passes = passes

    def synchronize(self) -> None:
        """Reduce the micro-batches now (collective), e.g. to clip or unscale the gradients before ``step()``.

        The gradients are then this step's: change them as you like (the same way on every
        rank) before ``step()``. A parameter whose gradient was inf or NaN in a micro-batch
        gets a NaN gradient, which ``step()`` reports (or GradScaler's ``unscale_`` finds).
        """
        reduction = self.gradients.reduce()
        if self._synchronized:  # again before step(): what the first found still holds
            earlier = self._synchronized_with
            reduction = Reduction(
                earlier.num_micro_batches + reduction.num_micro_batches,
                sorted({*earlier.nonfinite, *reduction.nonfinite}),
            )
        self._synchronized_with = reduction
        self._synchronized = True

    def close(self) -> None:
        """Remove the hooks; the wrapped optimizer keeps working as a local one."""
        self.gradients.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for compatibility: nothing is sent during backward anyway."""
        yield

    def step(self, closure=None, grad_scaler=None):
        """Reduce the micro-batches exactly (collective), then take the wrapped optimizer's step.

        Args:
            closure: called once first (its backward pass is one more micro-batch); its
                loss is returned.
            grad_scaler: passed by ``torch.amp.GradScaler.step``: the step unscales the
                exact mean and is skipped, and the scale lowered, when it is not finite.
        """
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                "this torch's GradScaler hands the scale to the optimizer as attributes, which reproducible=True "
                "does not read: unscale explicitly (optimizer.synchronize(); scaler.unscale_(optimizer))"
            )
        loss = None
        if self._synchronized:
            self._synchronized = False
            if closure is not None:
                raise RuntimeError("step(closure) after synchronize(): the closure's backward pass would be left out")
            self.gradients.adopt_grads()  # what the script made of the synchronized gradients is the step's
            self.gradients.reduce(expect_none=True)
            reduction = self._synchronized_with
        else:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            reduction = self.gradients.reduce()
        if grad_scaler is not None:
            self._scaled_step(grad_scaler, reduction)
        elif reduction.nonfinite:
            self._refuse_nonfinite(reduction.nonfinite)
        else:
            self._optimizer.step()
        self.gradients.adopt_grads()
        return loss

    def _refuse_nonfinite(self, names: list[str]) -> None:
        self.zero_grad()  # NaN now: the next step starts clean, whether this one raises or skips
        if not self.skip_nonfinite:
            shown = ", ".join(repr(name) for name in names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else ""
            )
            raise FloatingPointError(
                f"hpcddp: the gradient of {shown} was inf or NaN in a micro-batch on some rank: an exact sum cannot "
                "hold it; find why the loss is not finite, or pass skip_nonfinite=True to skip such steps"
            )
        self.skipped_steps += 1
        log.warning("hpcddp: skipped a step, a micro-batch gradient is inf or NaN (%d skipped)", self.skipped_steps)

    def _scaled_step(self, grad_scaler, reduction: Reduction) -> None:
        # GradScaler.step() hands itself over because _step_supports_amp_scaling is set: unscale the
        # exact mean here (unless the script did, after synchronize()), and skip on inf as it would.
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            grad_scaler.unscale_(self)
        elif reduction.num_micro_batches and not state["found_inf_per_device"]:  # alike on every rank
            raise RuntimeError(
                "scaler.unscale_(optimizer) ran before optimizer.synchronize(), when reproducible=True holds no "
                "gradients in p.grad yet, so it unscaled nothing: call optimizer.synchronize() before "
                "scaler.unscale_(optimizer)"
            )
        if not sum(float(found) for found in state["found_inf_per_device"].values()):
            self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients as torch does (and what was summed or synchronized since the last step).

        Args:
            set_to_none: as torch's (False zeroes them in place).
        """
        self._synchronized = False  # a synchronized step that is dropped
        self.gradients.zero_grad(set_to_none)  # it holds every parameter of the optimizer (collect_parameters)


DistributedOptimizer.reproducible_class = ReproducibleOptimizer


def _warn_if_threads_follow_the_world_size() -> None:
    from ..runtime import state
    from ..runtime.device import threads_follow_world_size

    runtime = state.current_runtime()
    if runtime is not None and state.rank() == 0 and threads_follow_world_size(runtime.config.num_threads):
        log.warning(
            "hpcddp: reproducible=True, but torch's threads per rank (%d) come from the cores per rank, which change "
            "with the world size, and some CPU kernels (LayerNorm, BatchNorm) sum differently with other thread "
            "counts: pass the same hpcddp.init(num_threads=N) (or OMP_NUM_THREADS) at every world size",
            runtime.num_threads,
        )
