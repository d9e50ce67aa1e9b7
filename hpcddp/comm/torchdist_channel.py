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
  the step's gradients and raises on every rank: the buckets did move, but their sums
  are never applied. (Buckets of other shapes pairing up, two optimizers reached in
  another order, can stall NCCL before the answer is read: the stall inspector and
  NCCL's timeout report it; never a wrong sum.)

The layouts (bucket sizes, dtypes, compression) were compared when the buckets were
built (``hpcddp.ddp.consistency.check_same_layout``). With checks off there is no
agreement, as on any communicator.
"""

from __future__ import annotations

import torch

from ._torchdist_ops import Agreeing
from .agreement import CollectiveMismatchError, describe_call
from .reduction import ReduceOp

__all__ = ["TorchDistGradientChannel"]


class TorchDistGradientChannel:
    """The step agreement of one optimizer's buckets on a ``TorchDistCommunicator`` (which also carries them).

    Args:
        comm: the optimizer's communicator.
    """

    def __init__(self, comm) -> None:
        #: the communicator the buckets' collectives run on: the optimizer's own
        self.comm = comm
        self._failure: str | None = None
        self._refused = False
        self._agreeing: Agreeing | None = None

    @property
    def failed(self) -> bool:
        """True once this rank left a step part-way (``fail``): its gradient collectives are out of step."""
        return self._failure is not None

    def open_step(self, bucket: torch.Tensor, *, label: str, step: int) -> None:
        """Agree on this step's reduction: at once on CPU tensors, later (``confirm_step``) on GPU ones.

        Args:
            bucket: bucket 0's tensor as sent (shape and dtype are compared).
            label: bucket 0's label, "bucket 0 of step 7" (the ranks compare it, and stall reports name it).
            step: the optimizer's step, which the ranks compare.
        """
        if self._failure is not None:
            raise RuntimeError(f"allreduce was not run: {self._failure}")
        self._refused, self._agreeing = False, None
        if not self.comm.check_collectives:
            return
        call = describe_call("allreduce", bucket, name=label, step=step, reduce_op=ReduceOp.SUM)
        agreeing = self.comm.start_agreement(call, label=label, step=step)
        if self.answer_at_launch(bucket):
            self._finish(agreeing)
        else:
            self._agreeing = agreeing

    @staticmethod
    def answer_at_launch(bucket: torch.Tensor) -> bool:
        """Whether the agreement on ``bucket`` is waited for at its launch: not on a GPU (a host sync in backward)."""
        return bucket.device.type != "cuda"

    def confirm_step(self) -> None:
        """Raise the step's CollectiveMismatchError (on every rank alike) unless its agreement held."""
        agreeing, self._agreeing = self._agreeing, None
        if agreeing is not None:
            self._finish(agreeing)

    def _finish(self, agreeing: Agreeing) -> None:
        try:
            self.comm.finish_agreement(agreeing)
        except CollectiveMismatchError:
            self._refused = True
            raise

    def refused_step(self) -> bool:
        """Return True when the current step's agreement failed: every rank raised its error."""
        return self._refused

    def fail(self, reason: str) -> None:
        """Refuse every later step on this rank: it left a step part-way, so the ranks are out of step.

        Args:
            reason: what happened, for the error.
        """
        if self._failure is None:
            self._failure = reason

    def close(self) -> None:
        """Nothing to release: the buckets ran on the optimizer's own communicator."""
