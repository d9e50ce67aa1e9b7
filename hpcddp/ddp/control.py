"""The control numbers that ride at the end of the last gradient bucket: no extra collective per step.

Summed over the ranks with the gradients, they tell every rank after each reduction
whether some rank saw a frozen parameter become trainable, how many ranks still had
data (``hpcddp.join``) and which ranks had a non-finite local gradient. They travel
in the bucket's dtype, so each count is a sum of at most 256 ones (bf16 counts
exactly to 256): ranks are counted in groups of 256.
"""

from __future__ import annotations

import torch

from .buckets import Bucket, probe_nonfinite

__all__ = ["ControlNumbers"]

_NOTHING_FOUND = torch.zeros((), dtype=torch.float64)

#: ranks counted in one control number: sums of ones stay exact in bf16 up to 256
RANKS_PER_COUNT = 256
# Layout: whether a parameter became trainable, then the ranks with data per group of
# RANKS_PER_COUNT ranks, then one flag per rank (non-finite gradients, or a pass that stopped).
_CHANGED, _ACTIVE = 0, 1
# A rank's flag: 1 when its gradients are not finite, this when its backward pass stopped part-way.
_STOPPED = 2.0


class ControlNumbers:
    """Write this rank's control numbers before the last bucket's reduction; read the sums after it.

    Args:
        rank: this rank in the communicator.
        size: the communicator's size.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self._nonfinite_at = _ACTIVE + -(-size // RANKS_PER_COUNT)
        #: how many numbers the last bucket carries
        self.size = self._nonfinite_at + size
        #: each bucket's probe of its local gradient in this reduction (inf or NaN when a gradient is)
        self.local_sums: list[torch.Tensor] = []
        #: this rank's backward pass stopped part-way (an exception): it sends the step's remaining
        #: buckets only so that every rank stays in step, and every rank raises instead of using the sums
        self.stopped = False

    def reset(self, num_buckets: int) -> None:
        """Forget the last reduction's probes and stop: a new reduction of ``num_buckets`` buckets begins."""
        self.local_sums = [_NOTHING_FOUND] * num_buckets
        self.stopped = False

    def write(self, control: torch.Tensor, has_data: bool, saw_new_trainable: bool) -> None:
        """Fill ``control`` with this rank's numbers as the last bucket is launched (``before_send`` adds the probes').

        Args:
            control: the last bucket's control view.
            has_data: False while this rank only shadows the others (``hpcddp.join``).
            saw_new_trainable: a frozen parameter got a gradient on this rank.
        """
        control.zero_()
        control[_ACTIVE + self.rank // RANKS_PER_COUNT] = 1.0 if has_data else 0.0
        control[_CHANGED] = 1.0 if saw_new_trainable else 0.0
        if self.stopped:
            control[self._nonfinite_at + self.rank] = _STOPPED

    def before_send(self, bucket: Bucket) -> None:
        """Probe ``bucket``'s local gradient just before it is sent, where it is sent; the last one carries the verdict.

        The buckets' communicator calls this in bucket order (on the communication thread
        when that sends the buckets while backward runs): the last bucket's flag says
        whether any bucket's probe was inf or NaN.
        """
        self.local_sums[bucket.index] = probe_nonfinite(bucket)
        if bucket.control is not None and not self.stopped:
            sums = torch.stack([s.to(bucket.control.device) for s in self.local_sums])
            bucket.control[self._nonfinite_at + self.rank] = torch.isfinite(sums).all().logical_not()

    def read(self, control: torch.Tensor) -> tuple[bool, int, list[int], list[int]]:
        """Return (a new trainable parameter, ranks with data, ranks with non-finite gradients, ranks that stopped).

        Args:
            control: the last bucket's control view, summed over the ranks.
        """
        numbers = control.tolist()
        active = sum(round(count) for count in numbers[_ACTIVE : self._nonfinite_at])
        flags = numbers[self._nonfinite_at :]
        nonfinite = [r for r, flag in enumerate(flags) if round(flag) == 1]
        stopped = [r for r, flag in enumerate(flags) if round(flag) == _STOPPED]
        return bool(numbers[_CHANGED]), active, nonfinite, stopped
