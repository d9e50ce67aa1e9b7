"""8-bit gradients with error feedback: a scatter-reduce and an allgather of int8 shards.

Per bucket and reduction (the scheme of Bagua's ByteGrad, with error feedback on both sides):

1. x = G + E_send (G: the bucket's gradients, zero-padded to ``size`` shards of a
   whole number of blocks; E_send: what this rank's earlier quantisation left out);
2. each block of ``block_size`` values is quantised to int8 with its own scale,
   ``max|x| / 127`` (round half to even, clamped to +-127, zero scale for an all-zero block), and
   E_send = x - dequantised;
3. an alltoall sends shard r (its int8 values and float32 scales) to rank r, which
   dequantises the shards it received and sums them in rank order;
4. the owner adds its E_own, quantises the sum the same way, keeps E_own = y - dequantised,
   and an allgather hands every rank every shard: the gradients become the dequantised sum.

A non-finite gathered scale (an inf or NaN on some rank, in its gradient or its memory) gives a
non-finite gradient for that reduction and starts every rank's memory afresh.

The bucket's tail (used counters, control numbers) travels exactly, in an allreduce of its own.
Traffic per rank: 2 (size - 1) / size bytes per gradient (plus 4 / ``block_size`` for
scales), a quarter of an fp32 ring allreduce's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...comm.base import Communicator, ReduceOp
from ..buckets import Bucket
from .staged import BucketCodec, Compressor, StagedReduction

__all__ = ["Int8"]


@dataclass(frozen=True)
class Int8(Compressor):
    """8-bit quantised gradients for ``DistributedOptimizer(compression=...)``; ``"int8"`` uses the defaults.

    Args:
        block_size: values sharing one scale (a multiple of 4; smaller follows
            outliers more closely and sends more scales).
        use_error_feedback: carry what quantisation left out into the next reduction.
    """

    block_size: int = 256
    use_error_feedback: bool = True
    name = "int8"

    def __post_init__(self) -> None:
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 4 or size % 4:
            raise ValueError(f"Int8 block_size must be a positive multiple of 4, got {size!r}")

    def codec(self, bucket: Bucket, comm: Communicator) -> BucketCodec:
        return _Int8Codec(self, bucket, comm)


def _quantize_into(blocks: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Write the rounded quotients of ``blocks`` (float32, one row per block) into ``scratch``; return the scales.

    The clamp matters for subnormal maxima only, whose scale max/127 rounds coarsely enough to
    put a quotient above 127. An inf or NaN makes its block's scale non-finite, and the
    dequantised block with it.
    """
    torch.abs(blocks, out=scratch)
    scales = scratch.amax(dim=1).div_(127)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    torch.div(blocks, divisor[:, None], out=scratch)
    scratch.round_().clamp_(-127, 127)
    return scales


class _Int8Codec(BucketCodec):
    def __init__(self, settings: Int8, bucket: Bucket, comm: Communicator) -> None:
        self.settings, self.bucket, self.comm = settings, bucket, comm
        block, size = settings.block_size, comm.size
        device = bucket.buffer.device
        count = bucket.grads.numel()
        blocks_per_shard = max(1, -(-count // (size * block)))
        self._shard = blocks_per_shard * block
        #: bytes of one shard on the wire: int8 values, then float32 scales
        self._width = self._shard + 4 * blocks_per_shard
        self._values = torch.zeros(size * self._shard, dtype=torch.float32, device=device)
        self._send_error = torch.zeros_like(self._values)
        self._own_error = torch.zeros(self._shard, dtype=torch.float32, device=device)
        self._own_values = torch.zeros(self._shard, dtype=torch.float32, device=device)
        self._scratch = torch.empty_like(self._values)
        self._tail = bucket.buffer[count:]

    def reset(self) -> None:
        self._send_error.zero_()
        self._own_error.zero_()

    def keep_unapplied(self, views: Sequence[torch.Tensor]) -> None:
        if not self.settings.use_error_feedback:
            return
        start, share = self.bucket.grads.storage_offset(), 1.0 / self.comm.size
        for view in views:
            at = view.storage_offset() - start
            self._send_error[at : at + view.numel()].add_(view.reshape(-1), alpha=share)

    def _encode(self, values: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        """Quantise ``values`` (already plus the error) into rows of wire bytes, one per shard; ``error``
        becomes what is left out."""
        block = self.settings.block_size
        rows = values.numel() // self._shard
        blocks = values.view(-1, block)
        scratch = self._scratch[: values.numel()].view(-1, block)
        scales = _quantize_into(blocks, scratch)
        wire = torch.empty(rows, self._width, dtype=torch.uint8, device=values.device)
        wire[:, : self._shard].view(torch.int8).copy_(scratch.view(rows, -1))
        wire[:, self._shard :].view(torch.float32).copy_(scales.view(rows, -1))
        if self.settings.use_error_feedback:
            torch.mul(scratch, scales[:, None], out=scratch)  # the rounded quotients times the scale: dequantised
            torch.sub(values, scratch.view(-1), out=error)
        return wire

    def _decode(self, wire: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the float32 values of each row of wire bytes into ``out`` (rows x shard); return it."""
        block = self.settings.block_size
        rows = wire.shape[0]
        quantized = wire[:, : self._shard].view(torch.int8).view(rows, -1, block)
        scales = wire[:, self._shard :].view(torch.float32).view(rows, -1, 1)
        torch.mul(quantized, scales, out=out.view(rows, -1, block))
        return out

    def launch(self, reduction: int, *, label: str, step: int | None) -> StagedReduction:
        grads = self.bucket.grads
        count = grads.numel()
        if self.settings.use_error_feedback:
            torch.add(grads, self._send_error[:count], out=self._values[:count])
        else:
            self._values[:count].copy_(grads)
        self._values[count:].zero_()  # the padding: the buffer held other ranks' shards since
        wire = self._encode(self._values, self._send_error)
        tail = self._tail
        handles = [] if tail.numel() == 0 else [self.comm.allreduce_async_(tail, ReduceOp.SUM, label=label, step=step)]
        self._exchange = self.comm.alltoall_async(wire, label=label, step=step)
        stages = [functools.partial(self._sum_own_shard, label=label, step=step), self._unpack]
        name = f"int8 bucket {self.bucket.index}"
        return StagedReduction(name, [*handles, self._exchange], stages, self.bucket.buffer)

    def _sum_own_shard(self, *, label: str, step: int | None):
        shards = self._decode(self._exchange.wait()[0], self._values.view(self.comm.size, -1))
        total = self._own_values
        total.copy_(shards[0])
        for shard in shards[1:]:  # in rank order, so the sum is the same whatever the backend
            total.add_(shard)
        if self.settings.use_error_feedback:
            total.add_(self._own_error)
        self._exchange = self.comm.allgather_async(
            self._encode(total, self._own_error).view(-1), label=label, step=step
        )
        return [self._exchange]

    def _unpack(self):
        wire = self._exchange.wait().view(self.comm.size, self._width)
        values = self._decode(wire, self._values.view(self.comm.size, -1)).view(-1)
        grads = self.bucket.grads
        grads.copy_(values[: grads.numel()])
        self._exchange = None
        # The gathered scales are the same on every rank: a non-finite one (an inf or NaN in some
        # rank's gradient or memory) gives a non-finite gradient now, and must not stay in the memory.
        if not bool(torch.isfinite(wire[:, self._shard :].view(torch.float32)).all()):
            self.reset()
        return []
