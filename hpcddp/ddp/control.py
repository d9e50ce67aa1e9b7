"""The control numbers that ride at the end of the last gradient bucket: no extra collective per step.

Summed over the ranks with the gradients, they tell every rank after each reduction
whether some rank saw a frozen parameter become trainable, how many ranks still had
data (``hpcddp.join``) and which ranks had a non-finite local gradient. They travel
in the bucket's dtype, so each count is a sum of at most 256 ones (bf16 counts
exactly to 256): ranks are counted in groups of 256.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ControlNumbers"]

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

    def write(
        self,
        control: torch.Tensor,
        has_data: bool,
        saw_new_trainable: bool,
        local_sums: Sequence[torch.Tensor],
        stopped: bool = False,
    ) -> None:
        """Fill ``control`` with this rank's numbers.

        Args:
            control: the last bucket's control view.
            has_data: False while this rank only shadows the others (``hpcddp.join``).
            saw_new_trainable: a frozen parameter got a gradient on this rank.
            local_sums: each bucket's local gradient sum (inf or NaN when a gradient is).
            stopped: this rank's backward pass stopped part-way (an exception): it sends the
                step's remaining buckets only so that every rank stays in step, and every
                rank raises instead of using the sums.
        """
        control.zero_()
        control[_ACTIVE + self.rank // RANKS_PER_COUNT] = 1.0 if has_data else 0.0
        control[_CHANGED] = 1.0 if saw_new_trainable else 0.0
        if stopped:
            control[self._nonfinite_at + self.rank] = _STOPPED
            return
        sums = torch.stack([s.to(control.device) for s in local_sums])
        control[self._nonfinite_at + self.rank] = torch.isfinite(sums).all().logical_not()

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
