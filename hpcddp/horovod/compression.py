"""``hvd.Compression``: the dtype tensors travel in; hpcddp's PowerSGD and int8 for DistributedOptimizer."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "BF16Compressor",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "Int8Compressor",
    "NoneCompressor",
    "PowerSGDCompressor",
]


class Compressor:
    """Horovod's interface: ``compress`` before the allreduce, ``decompress`` after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what ``decompress`` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the received tensor in its original form."""
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class _CastCompressor(Compressor):
    """Send floating-point tensors as ``dtype``; others as they are."""

    dtype: torch.dtype

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.dtype:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16."""

    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (hpcddp's addition)."""

    dtype = torch.bfloat16


class _OptimizerOnlyCompressor(Compressor):
    """A compression that keeps memory per gradient (error feedback): hvd.DistributedOptimizer only."""

    name = ""

    @classmethod
    def compress(cls, tensor):
        raise TypeError(
            f"hvd.Compression.{cls.name} works in hvd.DistributedOptimizer only (it keeps per-gradient memory): "
            "pass compression=hvd.Compression.fp16 or none to allreduce"
        )


class PowerSGDCompressor(_OptimizerOnlyCompressor):
    """Gradients as PowerSGD's low-rank factors (hpcddp's addition; ``hpcddp.PowerSGD`` for settings)."""

    name = "powersgd"


class Int8Compressor(_OptimizerOnlyCompressor):
    """Gradients as 8-bit blocks with error feedback (hpcddp's addition; ``hpcddp.Int8`` for settings)."""

    name = "int8"


class Compression:
    """``hvd.Compression.none`` / ``.fp16`` (and hpcddp's ``.bf16``, ``.powersgd``, ``.int8``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = PowerSGDCompressor
    int8 = Int8Compressor


#: what hpcddp.DistributedOptimizer's ``compression`` is for each compressor it supports
OPTIMIZER_COMPRESSION = {
    NoneCompressor: None,
    FP16Compressor: "fp16",
    BF16Compressor: "bf16",
    PowerSGDCompressor: "powersgd",
    Int8Compressor: "int8",
}
