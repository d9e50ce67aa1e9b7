"""Torch tensors as MPI buffers and torch's reduce ops as MPI ops, for the ``hpcddp`` process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm._mpi_buffers import HALF_DTYPES as _HALF
from ..comm._mpi_buffers import TORCH_TO_NUMPY as _NUMPY
from ..comm._mpi_buffers import bytes_view

__all__ = ["ReduceSpec", "bytes_view", "describe", "reduce_spec", "reduction_buffer", "stage", "unstage"]

_RED = dist.ReduceOp.RedOpType
_BITWISE = (_RED.BAND, _RED.BOR, _RED.BXOR)
_HALF_COMBINE = {_RED.SUM: torch.add, _RED.AVG: torch.add, _RED.PRODUCT: torch.mul}
_HALF_COMBINE.update({_RED.MIN: torch.minimum, _RED.MAX: torch.maximum})


class ReduceSpec:
    """How to reduce one dtype with one torch ReduceOp over MPI: the MPI op, and whether to divide after."""

    _half_ops: dict = {}

    def __init__(self, MPI, dtype: torch.dtype, op) -> None:
        kind = getattr(op, "op", op)  # a ReduceOp object or its RedOpType
        self.name = str(kind).rsplit(".", 1)[-1]
        self.average = kind == _RED.AVG
        if kind == _RED.PREMUL_SUM:
            raise ValueError("ReduceOp.PREMUL_SUM is NCCL-only: scale the tensor, then reduce with ReduceOp.SUM")
        if dtype not in _NUMPY and dtype not in _HALF:
            raise TypeError(f"the hpcddp backend cannot reduce tensors of dtype {dtype}: use a float or int dtype")
        if self.average and not dtype.is_floating_point:
            raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got {dtype}: use ReduceOp.SUM and divide")
        if kind in _BITWISE and dtype.is_floating_point:
            raise TypeError(f"ReduceOp.{self.name} needs an integer tensor, got {dtype}")
        if dtype in _HALF:
            self.mpi_op = self._half_op(MPI, dtype, kind)
        else:
            plain = {_RED.SUM: MPI.SUM, _RED.AVG: MPI.SUM, _RED.PRODUCT: MPI.PROD, _RED.MIN: MPI.MIN}
            plain.update({_RED.MAX: MPI.MAX, _RED.BAND: MPI.BAND, _RED.BOR: MPI.BOR, _RED.BXOR: MPI.BXOR})
            self.mpi_op = plain[kind]

    @classmethod
    def _half_op(cls, MPI, dtype, kind):
        key = (dtype, int(kind))
        if key not in cls._half_ops:
            combine = _HALF_COMBINE[kind]

            def reduce_half(inbuf, outbuf, datatype, dtype=dtype, combine=combine):
                out = torch.frombuffer(outbuf, dtype=dtype)
                combine(out, torch.frombuffer(inbuf, dtype=dtype), out=out)

            cls._half_ops[key] = MPI.Op.Create(reduce_half, commute=True)
        return cls._half_ops[key]

    def finish_(self, tensor: torch.Tensor, size: int) -> torch.Tensor:
        """Divide by ``size`` for AVG; return ``tensor``."""
        return tensor.div_(size) if self.average else tensor


def reduce_spec(MPI, dtype: torch.dtype, op) -> ReduceSpec:
    """Return how to reduce ``dtype`` with torch's ``op`` (raises TypeError/ValueError when MPI cannot)."""
    return ReduceSpec(MPI, dtype, op)


def reduction_buffer(MPI, tensor: torch.Tensor):
    """Return ``tensor`` (CPU, contiguous) as a typed buffer that MPI reduction ops accept."""
    if tensor.dtype in _HALF:
        return [tensor.view(torch.int16).numpy(), MPI.SHORT]
    return tensor.numpy()


def describe(tensors) -> str:
    """Return ``float32[4, 2]`` for one tensor, a comma-separated list for several (for messages)."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)


def stage(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` if MPI can use its memory (CPU, contiguous), else a CPU contiguous copy.

    The MPI library hpcddp is tested with is not CUDA-aware: GPU tensors travel
    through host memory (``hpcddp info`` says whether yours is).
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach()
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format)


def unstage(tensor: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """Copy ``staged`` back into ``tensor`` unless they share memory; return ``tensor``."""
    if staged.data_ptr() != tensor.data_ptr() or staged.device != tensor.device:
        with torch.no_grad():
            tensor.copy_(staged)
    return tensor
