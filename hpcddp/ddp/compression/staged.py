"""What a gradient compressor is to the Reducer: one codec per bucket, reductions in stages.

A compressed reduction is more than one collective with local work between them
(PowerSGD: allreduce P, orthogonalise, allreduce Q; int8: alltoall the quantised
shards, sum, allgather). The Reducer launches the first stage of each bucket while
backward goes on, starts every bucket's second stage before it waits for any
(``StagedReduction.advance``), then waits for them in bucket order, so every rank
submits the same collectives in the same order.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ...comm.base import Communicator, Handle
from ..buckets import Bucket

__all__ = ["BucketCodec", "Compressor", "StagedReduction"]

#: one stage: wait for nothing, compute, start the collectives the next stage waits for
Stage = Callable[[], Sequence[Handle]]


class Compressor(abc.ABC):
    """A gradient compression scheme: the settings, and a codec for each bucket."""

    #: the name DistributedOptimizer(compression=...) accepts for the default settings
    name: str = ""

    @abc.abstractmethod
    def codec(self, bucket: Bucket, comm: Communicator) -> BucketCodec:
        """Return the codec that reduces ``bucket`` over ``comm`` (it keeps the bucket's memory)."""


class BucketCodec(abc.ABC):
    """Reduces one bucket compressed; the result is the sum over the ranks, as an allreduce's.

    The bucket's tail (used counters, control numbers) must arrive exactly summed.
    """

    @abc.abstractmethod
    def launch(self, reduction: int, *, label: str, step: int | None) -> StagedReduction | None:
        """Start reducing the bucket for reduction number ``reduction``; None: send it uncompressed.

        Args:
            reduction: the reduction's number.
            label: the bucket's label, "bucket 2 of step 7": every stage's collectives carry it (stall reports).
            step: the optimizer's step, carried the same way.
        """

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the memory (error feedback, warm start), as after a non-finite gradient."""

    @abc.abstractmethod
    def keep_unapplied(self, views: Sequence[torch.Tensor]) -> None:
        """Add to the memory the reduced gradient of ``views``, which no rank used and the optimizer never sees.

        Their gradients were zeros, so what was sent for them was the memory itself; put back
        (each rank a 1/size share of the sum), it is sent again when they are next used and
        nothing the memory carried is lost.

        Args:
            views: the bucket's gradient views (``Bucket.views``) that go back to None, as reduced.
        """


class StagedReduction(Handle):
    """A bucket's reduction in stages; ``wait()`` runs the ones left and returns the bucket's buffer.

    Args:
        name: for messages.
        first: the first stage's collectives, in flight.
        stages: the stages after it; each waits for nothing itself: the previous
            stage's collectives are done when it runs. The last one writes the result.
            Their collectives carry the first's ``label`` and ``step`` (the codec binds them).
        result: what ``wait()`` returns.
    """

    def __init__(
        self,
        name: str,
        first: Sequence[Handle],
        stages: Sequence[Stage],
        result: torch.Tensor,
    ) -> None:
        super().__init__(name)
        self._in_flight = list(first)
        self._stages = deque(stages)
        self._output = result
        starts = [h.started_at for h in first if h.started_at is not None]
        self.started_at = min(starts) if starts else None

    def advance(self) -> None:
        """Wait for the collectives in flight and run the next stage (nothing once all have run)."""
        if not self._stages:
            return
        for handle in self._in_flight:
            handle.wait()
        stage = self._stages.popleft()
        self._in_flight = list(stage())

    def _block(self, timeout: float | None) -> bool:
        # The stages run in the waiting thread: the timeout bounds each wait, not the whole.
        if self.poll():
            return True
        try:
            while self._stages:
                self.advance()
            for handle in self._in_flight:
                handle.wait(timeout)
        except TimeoutError:
            return False
        except BaseException as error:  # noqa: BLE001 - handed to wait(), which raises it
            self.set_exception(error)
            return True
        finished = [h.completed_at for h in self._in_flight if h.completed_at is not None]
        self.completed_at = max(finished) if finished else None
        self.set_result(self._output)
        return True
