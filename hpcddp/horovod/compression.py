"""``hvd.Compression``: the dtype tensors travel in."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


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


class Compression:
    """``hvd.Compression.none`` / ``.fp16`` (and hpcddp's ``.bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


#: what hpcddp.DistributedOptimizer's ``compression`` is for each compressor it supports
OPTIMIZER_COMPRESSION = {NoneCompressor: None, FP16Compressor: "fp16", BF16Compressor: "bf16"}
