"""How a bucket travels: a plain allreduce (in its wire dtype, for fp16/bf16) or a compressor's codec."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..comm.base import BucketSums, Communicator, Handle
from .buckets import Bucket
from .compression import BucketCodec, Compressor, StagedReduction

__all__ = ["BucketSender"]


class BucketSender:
    """Starts each bucket's reduction and finishes it; holds the compression memory of every bucket.

    Args:
        comm: the communicator.
        compressor: PowerSGD, int8 or None (plain allreduces).
    """

    def __init__(self, comm: Communicator, compressor: Compressor | None) -> None:
        self.comm = comm
        self.compressor = compressor
        self._codecs: list[BucketCodec | None] = []
        self._sums: BucketSums | None = None
        self._buckets: list[Bucket] = []
        self._before_send: Callable[[int, int], None] | None = None

    def rebuild(self, buckets: Sequence[Bucket], before_send: Callable[[int, int], None]) -> None:
        """Make a codec per bucket and plan the plain sums; new buckets start their compression memory afresh.

        Args:
            buckets: the buckets.
            before_send: called with (first, stop) just before buckets ``first`` to ``stop - 1``
                are sent, where they are sent (the reducer's: the division and the non-finite probe).
        """
        compressor = self.compressor
        self._codecs = [None if compressor is None else compressor.codec(b, self.comm) for b in buckets]
        self._buckets = list(buckets)
        self._before_send = before_send
        tensors = [b.buffer if b.wire is None else b.wire for b in buckets]
        if compressor is None:  # the backend's way: MPI runs a step's buckets as one operation
            self._sums = self.comm.bucket_sums(tensors, self._ready)
        else:  # a bucket at a time, between the codecs' stages, each readied at its launch
            self._sums = BucketSums(self.comm, tensors)

    @property
    def overlap(self) -> bool:
        """True where the buckets are summed while backward runs; False where they wait for its end anyway
        (a CPU rank bound to one core), so starting them earlier gains nothing."""
        return self._sums.overlap

    def _ready(self, first: int, stop: int) -> None:
        """Ready buckets ``first`` to ``stop - 1`` as they are sent: scaled and probed, then copied in the wire dtype."""
        self._before_send(first, stop)
        for bucket in self._buckets[first:stop]:
            if bucket.wire is not None:
                bucket.wire.copy_(bucket.buffer)

    def start(
        self, first: int, stop: int, reduction: int, *, labels: Sequence[str], step: int, into: list[Handle]
    ) -> None:
        """Start summing buckets ``first`` to ``stop - 1`` over the ranks (reduction number ``reduction``).

        Args:
            first: the first bucket, filled, as are the others.
            stop: one past the last.
            reduction: the reduction's number (compressors start after a few).
            labels: their labels, "bucket 2 of step 7" (stall reports, the step's agreement).
            step: the optimizer's step they belong to.
            into: the step's handles, in bucket order: each bucket's is appended as it starts.
        """
        if self.compressor is None:
            self._sums.start(first, stop, labels=labels, step=step, into=into)
            return
        for index, label in zip(range(first, stop), labels):
            self._ready(index, index + 1)  # before the codec, which may change the bucket (error feedback)
            handle = self._codecs[index].launch(reduction, label=label, step=step)
            if handle is None:  # not compressed yet (PowerSGD's first steps): a plain sum
                self._sums.start(index, index + 1, labels=(label,), step=step, into=into)
            else:
                into.append(handle)

    def abandon(self) -> None:
        """The step ends before its last bucket started: the buckets' communicator waits for no more of it."""
        if self._sums is not None:
            self._sums.abandon()

    def wait(self, handles: Sequence[Handle]) -> None:
        """Wait for every bucket's reduction; raise the first failure, in bucket order.

        Compressed buckets move stage by stage, each one's next collective put in flight
        before any is waited for; plain ones are waited for as the backend's sums see fit
        (MPI: once for the step's operation).
        """
        if self.compressor is None:
            self._sums.wait(handles)
            return
        for handle in handles:
            if isinstance(handle, StagedReduction):
                handle.advance()
        for handle in handles:
            handle.wait()

    @staticmethod
    def copy_out(buckets: Sequence[Bucket]) -> None:
        """After the wait: move the buckets sent in another dtype back into their buffers."""
        for bucket in buckets:
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)

    def keep_unapplied(self, buckets: Sequence[Bucket]) -> None:
        """After a reduction: the compression memory keeps what was sent for the parameters no rank used."""
        for bucket, codec in zip(buckets, self._codecs):
            if codec is None or bool((bucket.used != 0).all()):
                continue
            codec.keep_unapplied([view for view, used in zip(bucket.views, bucket.used.tolist()) if used == 0])

    def reset(self) -> None:
        """Forget the compression memory of every bucket (after an inf or NaN, which would stay in it)."""
        for codec in self._codecs:
            if codec is not None:
                codec.reset()
