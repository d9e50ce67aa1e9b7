"""Where one parameter's gradient lives in its bucket, how each accumulation lands there, and how
the bucket is readied for its reduction and reset by ``zero_grad``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .buckets import Bucket, adopt_grad, write_used_flags

__all__ = [
    "IN_PLACE_BYTES",
    "GradSlot",
    "fill_bucket",
    "grads_outside",
    "hand_views",
    "note_grads_present",
    "reset_grads",
    "write_used",
]

#: a gradient this small is accumulated by autograd straight into its bucket view (``hand_views``)
#: instead of being divided into it by the hook. In a hook, between backward's kernels, the first
#: torch call costs 8-18 us here whatever its size (4 in a loop): more than the three extra passes
#: over memory (zeroing, adding in place, dividing apart) cost below about this size.
IN_PLACE_BYTES = 16 * 1024


@dataclass
class GradSlot:
    """One parameter's gradient view in a bucket, and what this reduction knows about it."""

    bucket: int
    view: torch.Tensor
    name: str
    #: got a gradient on this rank since the last reduction
    used: bool = False
    #: the view holds the gradient scaled (written so by the hook), not a raw sum
    scaled: bool = False
    #: the backward pass ``count`` belongs to, and the accumulations seen in it
    pass_id: int = -1
    count: int = 0
    #: accumulations per backward pass, learned (a weight used outside and inside a
    #: reentrant torch.utils.checkpoint accumulates twice)
    expected: int = 1
    #: the parameter had a gradient when this reduction's first backward pass began: if no
    #: rank uses it but one had a gradient, it keeps it (zeros, an earlier average), as in
    #: DDP; sent in the used-counter, so that every rank decides alike (a joined rank too)
    had_grad: bool = False
    #: got a gradient from backward on this rank since the last ``step()``
    landed: bool = False
    #: small enough for autograd to accumulate into the view in place (``IN_PLACE_BYTES``)
    in_place: bool = False
    #: backward gave it a dense gradient before: a dense view may be handed to autograd (a
    #: sparse gradient added to a dense view would stay dense, and the optimizer wants it sparse)
    dense: bool = False

    def land(
        self,
        param: torch.nn.Parameter,
        pass_id: int,
        *,
        learning: bool,
        reduces: bool,
        launched: bool,
        scale: float | None,
    ) -> None:
        """Count one accumulation of ``param.grad`` in backward pass ``pass_id`` and put it in the view.

        Args:
            param: the parameter whose gradient just accumulated.
            pass_id: the backward pass in progress.
            learning: the first pass, which learns how often each parameter accumulates.
            reduces: this pass ends in a reduction (else it only accumulates locally).
            launched: the bucket's reduction already started.
            scale: multiply a fresh gradient by this on its way in (``1 / predivide``, op AVERAGE), or None.
        """
        if self.pass_id != pass_id:
            self.pass_id, self.count = pass_id, 0
        self.count += 1
        self.used = self.landed = True
        if learning:
            self.expected = max(self.expected, self.count)
        if not reduces:
            adopt_grad(param, self.view)  # accumulate locally, in the bucket
            return
        if launched or (self.count > self.expected and self.scaled):
            raise RuntimeError(
                f"parameter {self.name!r} received gradient #{self.count} of one backward pass, more than the "
                f"{self.expected} of the first pass, after its share was reduced or scaled: its gradient "
                "would be wrong. A parameter used more often in one backward pass than in the first (reentrant "
                "torch.utils.checkpoint, a layer reused a varying number of times) cannot be reduced while "
                "backward runs: use torch.utils.checkpoint(..., use_reentrant=False), or use it equally often "
                "in every pass"
            )
        if self.count > self.expected:  # a raw sum in a bucket not yet sent: still right
            self.expected = self.count
        grad = param.grad
        if grad is self.view:
            return
        if grad.is_sparse:  # nn.Embedding(sparse=True): reduced dense
            grad = grad.to_dense()
        else:
            self.dense = True
        if learning or self.expected > 1 or scale is None or self.in_place:
            # Several accumulations may land in the view: keep it a raw sum, scaled where it is sent
            # (a small one too: one call there scales many, where a call here is dear).
            adopt_grad(param, self.view)
        else:
            # A large fresh gradient: scale it on its way into the bucket, which spares
            # a separate pass over the buffer later (DDP's mul_out).
            torch.mul(grad, scale, out=self.view)
            param.grad = self.view
            self.scaled = True


def note_grads_present(buckets: Sequence[Bucket], bucket_slots: Sequence[Sequence[GradSlot]]) -> None:
    """Set each slot's ``had_grad`` from its parameter, as a reduction's first backward pass begins.

    Called at that pass's first hook, after autograd wrote one gradient: that parameter is
    used on this rank, so what it had does not matter.
    """
    for bucket, slots in zip(buckets, bucket_slots):
        for param, slot in zip(bucket.params, slots):
            slot.had_grad = param.grad is not None


def grads_outside(buckets: Sequence[Bucket], bucket_slots: Sequence[Sequence[GradSlot]]) -> list[str]:
    """Name the parameters whose ``grad`` was assigned by hand since the last step: no hook saw it.

    Backward, a reduction and ``zero_grad`` leave every gradient in its view (or None);
    another tensor there, on a parameter backward gave no gradient since the last step,
    was assigned by hand (``p.grad = torch.autograd.grad(...)``). One backward did give
    (``p.grad = p.grad.clamp(...)`` after the reduction) derives from the average.
    """
    return [
        slot.name
        for bucket, slots in zip(buckets, bucket_slots)
        for param, slot in zip(bucket.params, slots)
        if param.grad is not None and param.grad is not slot.view and not slot.landed
    ]


def hand_views(pairs: Sequence[tuple[torch.nn.Parameter, GradSlot]]) -> None:
    """Make its zeroed view the gradient of each small parameter that has none, for autograd to add into.

    Called at the first hook of a reducing backward pass, before the other parameters'
    gradients accumulate, when no view holds a gradient (``zero_grad`` since the last
    launch): autograd then adds each gradient into its view in place (``AccumulateGrad``)
    instead of handing the hook a fresh tensor to copy, and the hooks have no tensor work
    left; the views are zeroed here in one call. A parameter this pass does not use is left
    with a view of zeros, which the reduction turns into the average or back into None, as
    it does for a gradient that is None at launch.

    Args:
        pairs: (parameter, slot) of the small parameters on the device whose pass began.
    """
    handed = [(param, slot.view) for param, slot in pairs if slot.dense and param.grad is None]
    if handed:
        # Here, not in zero_grad(): a gradient the script still holds keeps its values until backward, as before.
        torch._foreach_zero_([view for _, view in handed])
        for param, view in handed:
            param.grad = view


def fill_bucket(bucket: Bucket, slots: Sequence[GradSlot]) -> list[torch.Tensor]:
    """Ready ``bucket`` for its reduction: every gradient in its view; return the views still to scale.

    Args:
        bucket: the bucket about to be launched.
        slots: its parameters' slots, in the bucket's order.

    Returns:
        The gradients the hooks did not scale on their way in: the bucket's whole gradient
        part when that is all of them, scaled where the bucket is sent.
    """
    unscaled = []
    for param, slot in zip(bucket.params, slots):
        if not slot.scaled:
            if param.grad is not slot.view:
                adopt_grad(param, slot.view)
            unscaled.append(slot.view)
    return [bucket.grads] if len(unscaled) == len(bucket.views) else unscaled


def write_used(last: Bucket, slots: Sequence[GradSlot]) -> None:
    """Write every parameter's used-counter into the last bucket, as it is launched (every other bucket was).

    Args:
        last: the last bucket (``Bucket.all_used``).
        slots: every slot, in bucket order.
    """
    write_used_flags(last.all_used, [slot.used or slot.had_grad for slot in slots])


def reset_grads(buckets: Sequence[Bucket], set_to_none: bool) -> None:
    """Reset the buckets' gradients as torch's ``zero_grad`` does, keeping their views.

    Args:
        buckets: the buckets.
        set_to_none: gradients become None (the next backward writes each fresh
            gradient into its view); False zeroes the buffers and keeps the views.
    """
    if set_to_none:
        for bucket in buckets:
            for param in bucket.params:
                param.grad = None
        return
    if buckets:
        torch._foreach_zero_([bucket.grads for bucket in buckets])
    for bucket in buckets:
        for param, view in zip(bucket.params, bucket.views):
            # As torch's zero_grad(set_to_none=False): a gradient that is None stays None (no rank
            # used the parameter yet: optimizers skip it), the others become zeros in their view.
            if param.grad is not None and param.grad is not view:
                param.grad = view
