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

from .buckets import Bucket

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
        factor: what ``before_send`` multiplies gradients by before the sum (``1 / predivide``).
    """

    def __init__(self, rank: int, size: int, factor: float = 1.0) -> None:
        self.rank = rank
        self._factor = factor
        self._nonfinite_at = _ACTIVE + -(-size // RANKS_PER_COUNT)
        #: how many numbers the last bucket carries
        self.size = self._nonfinite_at + size
        #: device -> [found, 1, factor]: found is 1 once a gradient on it was not finite in this reduction
        self._probes: dict[torch.device, list[torch.Tensor]] = {}
        #: this rank's backward pass stopped part-way (an exception): it sends the step's remaining
        #: buckets only so that every rank stays in step, and every rank raises instead of using the sums
        self.stopped = False
        self._device: torch.device | None = None
        self._flag: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the last reduction's probes and stop: a new reduction begins."""
        for found, _, _ in self._probes.values():
            found.zero_()
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

    def plan(self, buckets: Sequence[Bucket]) -> None:
        """Learn the buckets' devices and dtypes, and where this rank's flag lies (after a rebuild)."""
        kinds = {(b.grads.device, b.grads.dtype == torch.float64) for b in buckets}
        #: the one device of every bucket when none holds float64 (one call each for scaling and probing)
        self._device = None
        if len(kinds) == 1:
            ((device, wide),) = kinds
            self._device = None if wide else device
        control = buckets[-1].control if buckets else None
        self._flag = None if control is None else control[self._nonfinite_at + self.rank :][:1]

    def before_send(
        self, buckets: Sequence[Bucket], scaled: Sequence[torch.Tensor], probed: Sequence[torch.Tensor]
    ) -> None:
        """Ready ``buckets`` to be sent, where and just before they are: scale, probe, and the last one's verdict.

        Multiplies ``scaled`` by the factor (the division before the sum, by the reciprocal as
        DDP does) and checks them in full, and checks ``probed`` (``Bucket.sample`` of the
        buckets not scaled whole): one call per device for any number of buckets (the check
        GradScaler makes, one kernel on a GPU), where a division and a probe per bucket cost
        two torch calls each. The buckets' communicator calls this in bucket order (on the
        communication thread when that sends the buckets while backward runs); the last
        bucket's flag says whether any gradient of the reduction was inf or NaN.

        Args:
            buckets: consecutive buckets, about to be sent.
            scaled: gradients of theirs to multiply (whole buckets' ``grads`` or views).
            probed: gradient samples of theirs to check only.
        """
        if self._device is not None:  # one device, no float64: the common case, two calls
            found, one, by = self._probe(self._device)
            if scaled:
                torch._amp_foreach_non_finite_check_and_unscale_(scaled, found, by)
            if probed:  # multiplied by 1: read only
                torch._amp_foreach_non_finite_check_and_unscale_(probed, found, one)
        else:
            self._before_send_mixed(scaled, probed)
        if buckets[-1].control is not None and not self.stopped:
            founds = [probe[0] for probe in self._probes.values()]
            flag = self._flag
            flag.copy_(founds[0] if len(founds) == 1 else torch.stack([f.to(flag.device) for f in founds]).amax())

    def _before_send_mixed(self, scaled: Sequence[torch.Tensor], probed: Sequence[torch.Tensor]) -> None:
        for device in {t.device for t in (*scaled, *probed)}:
            found, one, by = self._probe(device)
            mine = [t for t in scaled if t.device == device]
            # float64 gradients are multiplied by the float64 factor (as DDP does): the check's factor is float32.
            wide = [t for t in mine if t.dtype == torch.float64]
            narrow = [t for t in mine if t.dtype != torch.float64] if wide else mine
            if narrow:
                torch._amp_foreach_non_finite_check_and_unscale_(narrow, found, by)
            if wide:
                torch._foreach_mul_(wide, self._factor)
            checked = wide + [t for t in probed if t.device == device]
            if checked:  # multiplied by 1: read only
                torch._amp_foreach_non_finite_check_and_unscale_(checked, found, one)

    def _probe(self, device: torch.device) -> list[torch.Tensor]:
        probe = self._probes.get(device)
        if probe is None:
            probe = self._probes[device] = [
                # float32 whatever the default dtype: the check takes no other
                torch.zeros(1, dtype=torch.float32, device=device),
                torch.ones(1, dtype=torch.float32, device=device),
                torch.full((1,), self._factor, dtype=torch.float32, device=device),
            ]
        return probe

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
