"""Torch tensors as MPI buffers: dtypes, staging through host memory, reduction ops for 16-bit floats."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import ReduceOp

__all__ = [
    "HALF_DTYPES",
    "NUMPY_DTYPE_NAMES",
    "TORCH_TO_NUMPY",
    "MPIOps",
    "bytes_view",
    "displacements",
    "dtype_name",
    "empty_like",
    "explain_failure",
    "for_each_piece",
    "row_bytes",
    "staged",
    "write_back",
]

MB = 1 << 20
#: bytes per MPI call: MPI counts elements in 32-bit ints, and Open MPI's reductions of
#: larger messages hold several temporary copies (2.2 GB of fp16 grew a rank to 11.8 GB)
MESSAGE_PIECE_BYTES = 256 * MB

#: dtypes MPI reduces natively, and their numpy types
TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
#: dtypes MPI reduces natively, by name (the hot path looks names up here)
NUMPY_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in TORCH_TO_NUMPY}

# MPI has no standard 16-bit float: these travel as 2-byte integers and are combined
# by user-defined ops that view the bytes with the right dtype.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """Return ``dtype``'s name without the ``torch.`` prefix."""
    return NUMPY_DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """Return a contiguous CPU tensor's memory as a flat uint8 array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def staged(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` itself when MPI can use its memory (CPU, contiguous), else a contiguous CPU copy."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach() if tensor.requires_grad else tensor
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def write_back(tensor: torch.Tensor):
    """Return ``write(buffer)``, copying a contiguous result into ``tensor``; None when it cannot take one.

    An ``expand()``ed tensor (stride 0 along a dimension of size > 1) takes the result
    through its un-expanded view, each shared element once, as gloo writes it; a view
    whose elements overlap otherwise has no well-defined result: None.
    """
    if torch._debug_has_internal_overlap(tensor) != 1:

        def write(buffer: torch.Tensor) -> None:
            with torch.no_grad():
                tensor.copy_(buffer)

        return write
    index = tuple(
        slice(0, 1) if stride == 0 and size > 1 else slice(None) for size, stride in zip(tensor.shape, tensor.stride())
    )
    target = tensor[index]
    if torch._debug_has_internal_overlap(target) == 1:
        return None

    def write_unexpanded(buffer: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(buffer[index])

    return write_unexpanded


def for_each_piece(spec) -> list:
    """Split an mpi4py buffer spec (a flat array, or ``[array, datatype]``) into pieces of at most 256 MiB."""
    array, datatype = spec if isinstance(spec, list) else (spec, None)
    step = max(1, MESSAGE_PIECE_BYTES // max(array.itemsize, 1))
    if array.size <= step:
        return [spec]
    pieces = [array[i : i + step] for i in range(0, array.size, step)]
    return pieces if datatype is None else [[piece, datatype] for piece in pieces]


def row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (everything after the first dimension) of ``tensor``."""
    return int(np.prod(tensor.shape[1:], dtype=np.int64)) * tensor.element_size()


def displacements(counts: list[int]) -> list[int]:
    """Offsets of consecutive blocks of ``counts`` (for MPI's vector collectives)."""
    return np.cumsum([0, *counts[:-1]], dtype=np.int64).tolist()


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor like ``tensor``; on the CPU from numpy, which asks Linux for
    transparent huge pages: a fresh 64 MiB torch buffer took 2x as long to fill from MPI."""
    numpy_dtype = TORCH_TO_NUMPY.get(tensor.dtype)
    if tensor.device.type != "cpu" or numpy_dtype is None:
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return torch.from_numpy(np.empty(tuple(tensor.shape), dtype=numpy_dtype))


def explain_failure(err: BaseException, desc) -> BaseException:
    """Say what MPI's mismatched-count error means, naming the collective ``desc``."""
    if "MPI_ERR_TRUNCATE" not in str(err):
        return err
    explained = RuntimeError(
        f"{desc} failed with {err}: the ranks passed tensors of different sizes to the same collective "
        "(different models on different ranks, or data-dependent shapes)"
    )
    explained.__cause__ = err
    return explained


class MPIOps:
    """MPI reduction ops and buffer specs for every dtype hpcddp reduces."""

    def __init__(self, MPI) -> None:
        self._MPI = MPI
        self._created: dict[tuple[torch.dtype, ReduceOp], Any] = {}
        # Averages are sums, divided after.
        self.plain = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.AVERAGE: MPI.SUM,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
        }

    def check_reducible(self, dtype: torch.dtype, op: ReduceOp, what: str = "allreduce") -> None:
        """Raise TypeError for a dtype or op MPI cannot reduce."""
        if dtype not in TORCH_TO_NUMPY and dtype not in HALF_DTYPES:
            raise TypeError(f"{what} does not support tensors of dtype {dtype}")
        if op is ReduceOp.AVERAGE and not dtype.is_floating_point:
            raise TypeError(f"op='average' needs a floating-point tensor, got {dtype}: use op='sum'")
        if op.bitwise and (dtype.is_floating_point or dtype in HALF_DTYPES):
            raise TypeError(f"op='{op.value}' needs an integer tensor, got {dtype}")

    def op(self, dtype: torch.dtype, op: ReduceOp):
        """Return the MPI op reducing ``dtype`` with ``op``."""
        if dtype not in HALF_DTYPES:
            return self.plain[op]
        key = (dtype, op)
        if key not in self._created:
            combine = {ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum, ReduceOp.PRODUCT: torch.mul}.get(
                op, torch.add
            )

            def reduce_half(inbuf, outbuf, datatype, dtype=dtype, combine=combine):
                out = torch.frombuffer(outbuf, dtype=dtype)
                combine(out, torch.frombuffer(inbuf, dtype=dtype), out=out)

            self._created[key] = self._MPI.Op.Create(reduce_half, commute=True)
        return self._created[key]

    def buffer(self, tensor: torch.Tensor, counts=None, displs=None):
        """Return an mpi4py buffer spec for a contiguous CPU tensor (element counts, if given)."""
        if tensor.dtype in HALF_DTYPES:
            data, datatype = tensor.view(torch.int16).reshape(-1).numpy(), self._MPI.SHORT
        else:
            data, datatype = tensor.reshape(-1).numpy(), None
        if counts is None:
            return data if datatype is None else [data, datatype]
        if datatype is None:
            from mpi4py.util.dtlib import from_numpy_dtype

            datatype = from_numpy_dtype(data.dtype)
        return [data, counts, displs, datatype] if displs is not None else [data, counts, datatype]
