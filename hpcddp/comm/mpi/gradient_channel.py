"""One optimizer's gradient buckets on a communicator of their own, agreed once per step instead of once per bucket.

Every collective first agrees with the other ranks on what it is about to run (engine
rule 4): one latency-bound collective (2 log2(p) hops) per operation. For a model of 25
buckets that was 25 agreements per step, the step's largest fixed cost at 512 ranks
(docs/BENCHMARKS.md, "Control cost per step"). A ``GradientChannel`` keeps the
guarantee (two ranks never pair different data; a mismatch is an error on every rank)
with one agreement per step:

- **No other collective can pair with a bucket.** The channel is a duplicate of the
  optimizer's communicator that carries this optimizer's buckets and nothing else: the
  script's collectives, the torch backend's and another optimizer's buckets run on
  other communicators, so the order of a bucket relative to them does not matter.
- **Buckets pair with the same bucket of the same step.** Every rank launches them
  strictly in index order (``hpcddp.ddp.reducer``), with a layout (each bucket's
  size and dtype, the compression) the ranks compared when the buckets were built.
- **The step is agreed before any bucket moves.** ``before_bucket`` runs, at bucket 0, on the parent
  communicator at bucket 0's place in its order, the agreement that bucket 0 ran
  before: step, optimizer, shape, dtype. The channel's collectives of that step wait
  for it; if it fails (a rank skipped a backward pass, is a step ahead, called
  another collective instead, or the ranks reached two optimizers in another order),
  every rank raises its error for every bucket of the step without an MPI call, so
  the channel stays in step.
- **A rank that leaves a step part-way stops here.** An exception on one rank after
  some of its buckets (or compression stages) started, caught by the script, would
  make its next collective pair with another bucket on the others: the reducer then
  fails the channel (``fail``), and every later launch raises on that rank; the other
  ranks wait in the step's remaining buckets, which the stall inspector reports.
  (Each collective agreeing would turn this into an error on every rank; a job with a
  group timeout does agree per bucket here, and times out on every rank.)

With checks off and no timeout there is no agreement, as on any communicator.
"""

from __future__ import annotations

import torch

from ..base import Communicator, Handle, ReduceOp
from .engine import Collective

__all__ = ["GradientChannel"]


class GradientChannel:
    """A duplicate of ``parent`` for one optimizer's gradient buckets; each step agreed once, on ``parent``.

    Collective over ``parent``, as the optimizer's constructor is.

    Args:
        parent: the optimizer's communicator (an ``MPICommunicator``: ``duplicate``, ``call_for``, ``start``).
    """

    #: ``before_bucket`` agrees at bucket 0 only
    agrees_each_bucket = False

    def __init__(self, parent: Communicator) -> None:
        self.parent = parent
        #: the communicator the buckets' collectives run on (its own checks off: ``open_step`` agrees)
        self.comm = parent.duplicate(thread_name="buckets")
        self.comm.check_collectives = False

    def before_bucket(self, index: int, bucket: torch.Tensor, *, label: str, step: int) -> Handle | None:
        """At bucket 0, agree on this step's reduction on the parent; the channel's collectives wait for it.

        Returns the agreement's handle, or None for the other buckets and when the
        parent runs no agreements (checks off, no timeout).

        Args:
            index: the bucket's index; only bucket 0 opens a step.
            bucket: the bucket's tensor as sent (bucket 0's shape and dtype are compared).
            label: its label, "bucket 0 of step 7" (the ranks compare it, and stall reports name it).
            step: the optimizer's step, which the ranks compare.
        """
        if index != 0:
            return None
        engine = self.comm.engine
        engine.check_open("allreduce")  # out of step since an earlier step stopped part-way here (``fail``)
        # A group's timeout (engine rule 9) is measured in agreements: with one set, each bucket agrees
        # on the channel too, so a rank that stops part-way through a step times out everywhere.
        engine.agreement.timeout = self.parent.engine.agreement.timeout
        call = self.parent.call_for(None, "allreduce", bucket, label=label, step=step, reduce_op=ReduceOp.SUM)
        gate = (
            None
            if call is None
            # Not woken: the buckets' operation waits for it first and runs it there (engine rule 1), so
            # the parent's communication thread is not needed for it.
            else self.parent.start(Collective("allreduce", _nothing, bucket, call, label=label, step=step), wake=False)
        )
        engine.gate = gate
        return gate

    def confirm_step(self) -> None:
        """Nothing left to check once the buckets completed: they waited for the step's agreement."""

    @property
    def failed(self) -> bool:
        """True once the channel is out of step (``fail``, or a timeout): every later collective here raises."""
        return self.comm.engine.failed

    def refused_step(self) -> bool:
        """Return True when the current step's agreement failed: every rank raised its error, none sent a bucket."""
        gate = self.comm.engine.gate
        return gate is not None and gate.exception() is not None

    def fail(self, reason: str) -> None:
        """Refuse every later collective here: this rank left a step part-way, so the ranks are out of step.

        The other ranks wait in that step's buckets (the stall inspector names them);
        this rank raises ``reason`` at its next launch instead of pairing a bucket of
        one step with another's.

        Args:
            reason: what happened, for the error.
        """
        agreement = self.comm.engine.agreement
        if agreement.failure is None:
            agreement.failure = RuntimeError(reason)

    def close(self) -> None:
        """Stop the channel's communication thread and free its communicator."""
        self.comm.close()


def _nothing() -> None:
    return None
