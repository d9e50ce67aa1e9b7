"""One optimizer's gradient buckets on a torch.distributed group (gloo, nccl), agreed once per step.

gloo and nccl buckets are not compared one by one: that would cost a collective each,
and on a GPU a host sync each. Without any comparison, a rank that skipped a backward
pass but called ``step()`` is one step ahead with buckets of the same shapes, and the
ranks would average one step's gradients with another's, silently. As MPI's
``hpcddp.comm.mpi.gradient_channel``, this channel compares the step once, at bucket 0
(step, optimizer, shape, dtype: the same agreement), whatever the compression:

- **On CPU tensors (gloo) before any bucket moves.** The agreement's answer is waited
  for where bucket 0 is launched; a mismatch raises CollectiveMismatchError on every
  rank from ``backward()``, and no bucket of the step is sent.
- **On GPU tensors (nccl) before any reduced gradient is used.** Waiting where bucket 0
  is launched would be a host sync inside backward, so the agreement travels ahead of
  bucket 0 on the same stream and is read (``confirm_step``) once the step's buckets
  are waited for, where the reducer reads the control numbers anyway. A mismatch drops
  the step's gradients (and the compression memory) and raises on every rank: the
  buckets did move, but their sums are never applied. (Buckets of other shapes pairing
  up, two optimizers reached in another order, can stall NCCL before the answer is
  read; and a rank whose script runs another collective where the others launch bucket
  0 learns of the mismatch at once, and waits to gather the calls while the others wait
  in their buckets: the stall inspector ends the job naming both, NCCL's timeout too;
  never a wrong sum.)
- **Every bucket agrees once two optimizers share the group.** MPI gives each
  optimizer's buckets a communicator of their own, so a bucket can only pair with the
  same bucket of the same optimizer. Here they share the optimizer's group: two
  optimizers whose buckets interleave in another order on another rank (layers run in
  another order) would pair one's bucket 2 with the other's bucket 1, both past the
  step's check. From the second channel made on a communicator on (made at the same
  point on every rank: an optimizer's constructor is collective) every bucket of every
  channel there agrees, as above (at launch on CPUs, read with the step's on GPUs),
  its label naming the bucket and the optimizer.

The layouts (bucket sizes, dtypes, compression) were compared when the buckets were
built (``hpcddp.ddp.consistency.check_same_layout``). With checks off there is no
agreement, as on any communicator.
"""

from __future__ import annotations

import collections

import torch

from ._torchdist_work import Agreeing
from .agreement import CollectiveMismatchError, describe_call
from .reduction import ReduceOp

__all__ = ["GroupChannels", "TorchDistGradientChannel"]


class GroupChannels:
    """What the gradient channels of one torch.distributed group share: how many were made, and the
    agreements to read later (GPUs), in the order they were issued on the group."""

    def __init__(self) -> None:
        #: channels made on the group so far (the same count on every rank: constructors are collective)
        self.made = 0
        self.in_flight: collections.deque[tuple[TorchDistGradientChannel, Agreeing]] = collections.deque()


class TorchDistGradientChannel:
    """The step agreement of one optimizer's buckets on a ``TorchDistCommunicator`` (which also carries them).

    Args:
        comm: the optimizer's communicator.
    """

    def __init__(self, comm) -> None:
        #: the communicator the buckets' collectives run on: the optimizer's own
        self.comm = comm
        self._group: GroupChannels = comm.gradient_channels
        self._group.made += 1
        self._failure: str | None = None
        #: the error this step was refused with, every rank alike (None: not refused)
        self._refusal: CollectiveMismatchError | None = None
        self._in_flight = 0  # this channel's agreements in ``GroupChannels.in_flight``

    @property
    def agrees_each_bucket(self) -> bool:
        """True where optimizers share the group: ``before_bucket`` agrees on every bucket, not only bucket 0."""
        return self._group.made >= 2

    @property
    def failed(self) -> bool:
        """True once this rank left a step part-way (``fail``): its gradient collectives are out of step."""
        return self._failure is not None

    def before_bucket(self, index: int, bucket: torch.Tensor, *, label: str, step: int) -> None:
        """Agree on bucket 0 (the step), or on every bucket where optimizers share the group: now on CPU tensors,
        at ``confirm_step`` on GPU ones.

        Args:
            index: the bucket's index.
            bucket: its tensor as sent (shape and dtype are compared).
            label: its label, "bucket 0 of step 7" (the ranks compare it, and stall reports name it).
            step: the optimizer's step, which the ranks compare.
        """
        if index == 0:
            if self._failure is not None:
                raise RuntimeError(f"allreduce was not run: {self._failure}")
            if self._in_flight:
                self.confirm_step()  # a step left unconfirmed (an exception before its end): read in order first
            self._refusal = None
        elif self._group.made < 2:
            return
        if not self.comm.check_collectives:
            return
        call = describe_call("allreduce", bucket, name=label, step=step, reduce_op=ReduceOp.SUM)
        self._group.in_flight.append((self, self.comm.start_agreement(call, label=label, step=step)))
        self._in_flight += 1
        if self.answer_at_launch(bucket):
            self.confirm_step()

    @staticmethod
    def answer_at_launch(bucket: torch.Tensor) -> bool:
        """Whether the agreement on ``bucket`` is waited for at its launch: not on a GPU (a host sync in backward)."""
        return bucket.device.type != "cuda"

    def confirm_step(self) -> None:
        """Raise the step's CollectiveMismatchError (on every rank alike) unless its agreements held.

        The group's agreements are read in the order they were issued, up to this channel's
        last: the k-th agreement of every rank paired, so every rank finds the same first
        mismatch, gathers the calls that paired there, and refuses the steps of the same
        channels (those with an agreement from there on), whichever optimizer it confirms first.
        """
        if self._refusal is not None:
            raise self._refusal
        queue = self._group.in_flight
        while self._in_flight:
            owner, agreeing = queue.popleft()
            owner._in_flight -= 1
            try:
                self.comm.finish_agreement(agreeing)
            except CollectiveMismatchError as err:
                refused = {owner} | {other for other, _ in queue}
                queue.clear()
                for channel in refused:
                    channel._refusal, channel._in_flight = err, 0
                raise

    def refused_step(self) -> bool:
        """Return True when the current step's agreement failed: every rank raised its error."""
        return self._refusal is not None

    def fail(self, reason: str) -> None:
        """Refuse every later step on this rank: it left a step part-way, so the ranks are out of step.

        Args:
            reason: what happened, for the error.
        """
        if self._failure is None:
            self._failure = reason

    def close(self) -> None:
        """Nothing to release: the buckets ran on the optimizer's own communicator."""
