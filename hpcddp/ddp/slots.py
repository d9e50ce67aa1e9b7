"""Where one parameter's gradient lives in its bucket, how each accumulation lands there, and how
the bucket is readied for its reduction and reset by ``zero_grad``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .buckets import Bucket, adopt_grad, write_used_flags

__all__ = ["GradSlot", "fill_bucket", "grads_outside", "note_grads_present", "reset_bucket_grads", "write_used"]


@dataclass
class GradSlot:
    """One parameter's gradient view in a bucket, and what this reduction knows about it."""

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
    #: the parameter had a gradient when this reduction's first backward pass began: if no
    #: rank uses it but one had a gradient, it keeps it (zeros, an earlier average), as in
    #: DDP; sent in the used-counter, so that every rank decides alike (a joined rank too)
    had_grad: bool = False
    #: got a gradient from backward on this rank since the last ``step()``
    landed: bool = False

    def land(
        self,
        param: torch.nn.Parameter,
        pass_id: int,
        *,
        learning: bool,
        reduces: bool,
        launched: bool,
        divide_by: float | None,
    ) -> None:
        """Count one accumulation of ``param.grad`` in backward pass ``pass_id`` and put it in the view.

        Args:
            param: the parameter whose gradient just accumulated.
            pass_id: the backward pass in progress.
            learning: the first pass, which learns how often each parameter accumulates.
            reduces: this pass ends in a reduction (else it only accumulates locally).
            launched: the bucket's reduction already started.
            divide_by: divide a fresh gradient by this on its way in (op AVERAGE), or None.
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
        if grad is not self.view and grad.is_sparse:  # nn.Embedding(sparse=True): reduced dense
            grad = grad.to_dense()
        if grad is self.view:
            return
        if learning or self.expected > 1 or divide_by is None:
            # Several accumulations may land in the view: keep it a raw sum, divided at launch.
            adopt_grad(param, self.view)
        else:
            # A fresh gradient: divide it on its way into the bucket, which spares
            # a separate pass over the buffer at launch.
            torch.div(grad, divide_by, out=self.view)
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


def fill_bucket(bucket: Bucket, slots: Sequence[GradSlot], divide_by: float | None) -> None:
    """Ready ``bucket`` for its reduction: every gradient in its view, divided.

    Args:
        bucket: the bucket about to be launched.
        slots: its parameters' slots, in the bucket's order.
        divide_by: divide the gradients not yet divided by this (op AVERAGE), or None.
    """
    unscaled = []
    for param, slot in zip(bucket.params, slots):
        if not slot.scaled:
            adopt_grad(param, slot.view)
            unscaled.append(slot.view)
    if divide_by is not None and divide_by != 1.0 and unscaled:
        # Divide before summing, as DDP does: it keeps fp16 sums in range.
        if len(unscaled) == len(bucket.views):
            bucket.grads.div_(divide_by)
        else:
            for view in unscaled:
                view.div_(divide_by)


def write_used(last: Bucket, slots: Sequence[GradSlot]) -> None:
    """Write every parameter's used-counter into the last bucket, as it is launched (every other bucket was).

    Args:
        last: the last bucket (``Bucket.all_used``).
        slots: every slot, in bucket order.
    """
    write_used_flags(last.all_used, [slot.used or slot.had_grad for slot in slots])


def reset_bucket_grads(bucket: Bucket, set_to_none: bool) -> None:
    """Reset the bucket's gradients as torch's ``zero_grad`` does, keeping its views.

    Args:
        bucket: the bucket.
        set_to_none: gradients become None (the next backward writes each fresh
            gradient into its view); False zeroes the buffer and keeps the views.
    """
    if set_to_none:
        for param in bucket.params:
            param.grad = None
        return
    bucket.grads.zero_()
    for param, view in zip(bucket.params, bucket.views):
        # As torch's zero_grad(set_to_none=False): a gradient that is None stays None (no rank
        # used the parameter yet: optimizers skip it), the others become zeros in their view.
        if param.grad is not None and param.grad is not view:
            param.grad = view
