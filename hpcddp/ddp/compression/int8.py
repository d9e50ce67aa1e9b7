"""8-bit gradients with error feedback: a scatter-reduce and an allgather of int8 shards.

Per bucket and reduction (the scheme of Bagua's ByteGrad, with error feedback on both sides):

1. x = G + E_send (G: the bucket's gradients, zero-padded to ``size`` shards of a
   whole number of blocks; E_send: what this rank's earlier quantisation left out);
2. each block of ``block_size`` values is quantised to int8 with its own scale,
   ``max|x| / 127`` (round half to even, zero scale for an all-zero block), and
   E_send = x - dequantised;
3. an alltoall sends shard r (its int8 values and float32 scales) to rank r, which
   dequantises the shards it received and sums them in rank order;
4. the owner adds its E_own, quantises the sum the same way, keeps E_own = y - dequantised,
   and an allgather hands every rank every shard: the gradients become the dequantised sum.

The bucket's tail (used counters, control numbers) travels exactly, in an allreduce of its own.
Traffic per rank: 2 (size - 1) / size bytes per gradient (plus 4 / ``block_size`` for
scales), a quarter of an fp32 ring allreduce's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.base import Communicator, ReduceOp
from ...comm.oplog import current_tag
from ..buckets import Bucket
from .staged import BucketCodec, Compressor, StagedReduction

__all__ = ["Int8", "dequantize", "quantize"]


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


def quantize(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (int8 values, float32 scale per block) of float32 ``values`` (length a multiple of ``block_size``)."""
    blocks = values.view(-1, block_size)
    scales = blocks.abs().amax(dim=1) / 127
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = (blocks / divisor[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return quantized.view(-1), scales


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Return the float32 values ``quantize`` approximated."""
    return (quantized.view(-1, block_size).to(torch.float32) * scales[:, None]).view(-1)


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
        self._tail = bucket.buffer[count:]

    def reset(self) -> None:
        self._send_error.zero_()
        self._own_error.zero_()

    def _encode(self, values: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        """Quantise ``values`` (+ ``error``, updated to what is left out) into rows of wire bytes, one per shard."""
        if self.settings.use_error_feedback:
            values.add_(error)
        quantized, scales = quantize(values, self.settings.block_size)
        if self.settings.use_error_feedback:
            torch.sub(values, dequantize(quantized, scales, self.settings.block_size), out=error)
        rows = values.numel() // self._shard
        wire = torch.empty(rows, self._width, dtype=torch.uint8, device=values.device)
        wire[:, : self._shard].copy_(quantized.view(rows, -1).view(torch.uint8))
        wire[:, self._shard :].copy_(scales.view(rows, -1).view(torch.uint8))
        return wire

    def _decode(self, wire: torch.Tensor) -> torch.Tensor:
        """Return the float32 values of each row of wire bytes, as a (rows, shard) tensor."""
        quantized = wire[:, : self._shard].contiguous().view(torch.int8)
        scales = wire[:, self._shard :].contiguous().view(torch.float32)
        block = self.settings.block_size
        return dequantize(quantized.reshape(-1), scales.reshape(-1), block).view(wire.shape[0], self._shard)

    def launch(self, reduction: int) -> StagedReduction:
        grads = self.bucket.grads
        self._values.zero_()
        self._values[: grads.numel()].copy_(grads)
        wire = self._encode(self._values, self._send_error)
        handles = [] if self._tail.numel() == 0 else [self.comm.allreduce_async_(self._tail, ReduceOp.SUM)]
        self._exchange = self.comm.alltoall_async(wire)
        stages = [self._sum_own_shard, self._unpack]
        name = f"int8 bucket {self.bucket.index}"
        return StagedReduction(name, [*handles, self._exchange], stages, current_tag(), self.bucket.buffer)

    def _sum_own_shard(self):
        shards = self._decode(self._exchange.wait()[0])
        total = shards[0].clone()
        for shard in shards[1:]:  # in rank order, so the sum is the same whatever the backend
            total.add_(shard)
        self._exchange = self.comm.allgather_async(self._encode(total, self._own_error).view(-1))
        return [self._exchange]

    def _unpack(self):
        values = self._decode(self._exchange.wait().view(self.comm.size, self._width)).view(-1)
        grads = self.bucket.grads
        grads.copy_(values[: grads.numel()])
        self._exchange = None
        return []
