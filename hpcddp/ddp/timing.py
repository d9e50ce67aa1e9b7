"""When each step of a reduction happened: for overlap checks, ``hpcddp bench`` and the timeline."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..comm.base import Handle
from .buckets import MB, Bucket

__all__ = ["ReductionTimes"]


@dataclass
class ReductionTimes:
    """perf_counter timestamps of the last reduction, for overlap checks and timelines.

    On nccl a bucket's end is known from a CUDA event only once its kernels ran, after
    ``wait()`` returned: it is read when ``bucket_done`` is, waiting for those events then,
    so that the reduction itself adds no host synchronisation.
    """

    backward_start: float = 0.0
    backward_end: float = 0.0
    #: seconds spent finishing reductions (waiting for the buckets), summed over the reducer's life
    wait_total: float = 0.0
    #: when the last reduction's wait ended
    wait_end: float = 0.0
    #: seconds the last reduction's bucket launches blocked inside backward (gloo agrees on the
    #: step's calls at bucket 0's launch, waiting there for the other ranks); in ``wait_total`` too
    launch_wait: float = 0.0
    bucket_launch: list[float] = field(default_factory=list)
    #: when each bucket's buffer went to the backend (after predivide and compression)
    bucket_submit: list[float] = field(default_factory=list)
    _done: list[float] = field(default_factory=list, repr=False)
    #: bucket index -> (its handle, when its copy-out began), for ends not yet known
    _unresolved: dict = field(default_factory=dict, repr=False)

    @property
    def bucket_done(self) -> list[float]:
        """When each bucket's reduction finished in the backend (on a GPU: when its kernels ran)."""
        for index, (handle, copy_out_start) in list(self._unresolved.items()):
            self._done[index] = handle.completion_time() or copy_out_start
            del self._unresolved[index]
        return self._done

    @bucket_done.setter
    def bucket_done(self, value: list[float]) -> None:
        self._done = value
        self._unresolved = {}

    def waited(self, start: float) -> None:
        """Note that a wait for the launched buckets, begun at ``start``, ended now."""
        self.wait_end = time.perf_counter()
        self.wait_total += self.wait_end - start

    def launch_waited(self, start: float) -> None:
        """Note that a bucket's launch inside backward, begun at ``start``, blocked until now (a wait, not compute)."""
        waited = time.perf_counter() - start
        self.launch_wait += waited
        self.wait_total += waited

    def begin(self, num_buckets: int) -> None:
        """A reduction of ``num_buckets`` buckets launches its first bucket now (the launcher stamps
        ``bucket_launch`` and ``bucket_submit``)."""
        self.launch_wait = 0.0
        self.bucket_launch = [0.0] * num_buckets
        self.bucket_submit = [0.0] * num_buckets
        self.bucket_done = [0.0] * num_buckets

    def done(
        self, buckets: Sequence[Bucket], handles: Sequence[Handle], copy_out_start: float, recorder, step: int
    ) -> None:
        """Note that the reductions of ``buckets`` finished, and record them in the timeline if one is kept.

        Args:
            buckets: the reduced buckets.
            handles: their finished reductions, in the same order.
            copy_out_start: when their results began to be copied out of the wire buffers.
            recorder: the timeline recorder, or None.
            step: the reduction's number (the timeline's step).
        """
        copied = time.perf_counter()
        for bucket, handle in zip(buckets, handles):
            # When the backend finished it, not when we looked: that shows the overlap.
            if handle.completed_at is not None:
                self._done[bucket.index] = handle.completed_at
            else:
                self._done[bucket.index] = copy_out_start
                self._unresolved[bucket.index] = (handle, copy_out_start)
            if recorder is not None:
                recorder.bucket_reduction(
                    bucket.index,
                    self.bucket_launch[bucket.index],
                    self.bucket_submit[bucket.index],
                    handle,
                    (copy_out_start, copied),
                    step=step,
                    mib=round(bucket.nbytes / MB, 3),
                )
