"""torch.distributed's reduce ops as hpcddp's, and tensors staged where MPI can read and write them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.base import ReduceOp
from ..comm.p2p import describe_tensors as describe

__all__ = ["describe", "reduce_op_of", "stage", "unstage"]

_RED = dist.ReduceOp.RedOpType
_FROM_TORCH = {
    _RED.SUM: ReduceOp.SUM,
    _RED.AVG: ReduceOp.AVERAGE,
    _RED.PRODUCT: ReduceOp.PRODUCT,
    _RED.MIN: ReduceOp.MIN,
    _RED.MAX: ReduceOp.MAX,
    _RED.BAND: ReduceOp.BAND,
    _RED.BOR: ReduceOp.BOR,
    _RED.BXOR: ReduceOp.BXOR,
}


def reduce_op_of(op) -> ReduceOp:
    """Return hpcddp's ReduceOp for torch's ``op`` (a ``dist.ReduceOp`` or its ``RedOpType``).

    Raises ValueError for PREMUL_SUM, which is NCCL's alone.
    """
    kind = getattr(op, "op", op)
    if kind == _RED.PREMUL_SUM:
        raise ValueError("ReduceOp.PREMUL_SUM is NCCL-only: scale the tensor, then reduce with ReduceOp.SUM")
    return _FROM_TORCH[kind]


def stage(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` if MPI can use its memory (CPU, contiguous), else a CPU contiguous copy.

    The MPI library hpcddp is tested with is not CUDA-aware: GPU tensors travel
    through host memory (``hpcddp info`` says whether yours is).
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach()
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def unstage(tensor: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """Copy ``staged`` into ``tensor`` unless it is ``tensor``'s own memory; return ``tensor``."""
    if staged.data_ptr() != tensor.data_ptr() or staged.device != tensor.device or staged.stride() != tensor.stride():
        with torch.no_grad():
            tensor.copy_(staged.reshape(tensor.shape))
    return tensor
