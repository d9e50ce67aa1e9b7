"""When each step of a reduction happened: for overlap checks, ``hpcddp bench`` and the timeline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..comm.base import Handle
from .buckets import MB, Bucket

__all__ = ["ReductionTimes"]


@dataclass
class ReductionTimes:
    """perf_counter timestamps of the last reduction, for overlap checks and timelines."""

    backward_start: float = 0.0
    backward_end: float = 0.0
    bucket_launch: list[float] = field(default_factory=list)
    #: when each bucket's buffer went to the backend (after predivide and compression)
    bucket_submit: list[float] = field(default_factory=list)
    bucket_done: list[float] = field(default_factory=list)

    def launched(self, index: int, num_buckets: int) -> None:
        """Note that bucket ``index`` of ``num_buckets`` is being launched now."""
        if index == 0 or len(self.bucket_launch) != num_buckets:
            self.bucket_launch = [0.0] * num_buckets
            self.bucket_submit = [0.0] * num_buckets
            self.bucket_done = [0.0] * num_buckets
        self.bucket_launch[index] = time.perf_counter()

    def done(self, bucket: Bucket, handle: Handle, copy_out_start: float, recorder, step: int) -> None:
        """Note that ``bucket``'s reduction finished, and record it in the timeline if one is kept.

        Args:
            bucket: the reduced bucket.
            handle: its finished reduction.
            copy_out_start: when its result began to be copied out of the wire buffer.
            recorder: the timeline recorder, or None.
            step: the reduction's number (the timeline's step).
        """
        # When the backend finished it, not when we looked: that shows the overlap.
        self.bucket_done[bucket.index] = handle.completed_at or copy_out_start
        if recorder is not None:
            recorder.bucket_reduction(
                bucket.index,
                self.bucket_launch[bucket.index],
                self.bucket_submit[bucket.index],
                handle,
                (copy_out_start, time.perf_counter()),
                step=step,
                mib=round(bucket.nbytes / MB, 3),
            )
