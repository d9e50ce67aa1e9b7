"""The one table of dtypes: each torch dtype hpcddp moves, as numpy and MPI see its elements.

Every backend, message and agreement names a dtype through here (``dtype_name``), and
every MPI buffer is typed through here (``mpi_datatype``): MPI reduces the native dtypes
with its own ops; MPI has no standard 16-bit float, so float16 and bfloat16 travel as
2-byte integers and are combined by user-defined ops (``hpcddp.comm.reduction``). bool
travels as ``MPI_C_BOOL``, which MPI reduces with its logical ops only (``MPI_LOR``,
``MPI_LAND``, ``MPI_LXOR``: ``hpcddp.comm.reduction`` maps torch's ops onto them).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "host_array",
    "DTYPES",
    "HALF_DTYPES",
    "Carried",
    "dtype_name",
    "dtype_named",
    "mpi_datatype",
    "numpy_view",
]


class Carried(NamedTuple):
    """How a torch dtype's elements travel through MPI."""

    #: the numpy type MPI sees the elements as (its MPI datatype follows from it)
    numpy: type
    #: MPI's own ops reduce it; False: the 16-bit floats, combined by hpcddp's user-defined ops
    native: bool


#: torch dtype -> how MPI carries it; the dtypes hpcddp reduces (any dtype moves as bytes)
DTYPES: dict[torch.dtype, Carried] = {
    torch.float64: Carried(np.float64, True),
    torch.float32: Carried(np.float32, True),
    torch.float16: Carried(np.int16, False),
    torch.bfloat16: Carried(np.int16, False),
    torch.int64: Carried(np.int64, True),
    torch.int32: Carried(np.int32, True),
    torch.int16: Carried(np.int16, True),
    torch.int8: Carried(np.int8, True),
    torch.uint8: Carried(np.uint8, True),
    torch.bool: Carried(np.bool_, True),
}
HALF_DTYPES = tuple(dtype for dtype, carried in DTYPES.items() if not carried.native)

# The hot path names dtypes on every collective: looked up, not formatted.
_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in (*DTYPES, torch.bool, torch.complex64)}
_BY_NAME = {name: dtype for dtype, name in _NAMES.items()}
_DATATYPES: dict[torch.dtype, object] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """Return ``dtype``'s name as messages, logs and the agreement write it: ``float32``."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def dtype_named(name: str) -> torch.dtype:
    """Return the torch dtype ``dtype_name`` calls ``name``."""
    dtype = _BY_NAME.get(name) or getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """Return a contiguous CPU tensor of a dtype in ``DTYPES`` as a flat numpy array of its carried type (no copy)."""
    flat = tensor.reshape(-1)
    return host_array(flat if DTYPES[tensor.dtype].native else flat.view(torch.int16))


class _TensorMemory:
    """What a ``host_array`` views: the tensor's memory, and the tensor itself, kept alive as the array's base."""

    def __init__(self, tensor: torch.Tensor, typestr: str) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": (tensor.numel(),),
            "typestr": typestr,
            "version": 3,
        }


_TYPESTRS: dict[torch.dtype, str] = {}


def host_array(flat: torch.Tensor) -> np.ndarray:
    """Return a 1-D contiguous CPU tensor's memory as a numpy array (no copy), leaving the tensor as it was.

    ``tensor.numpy()`` marks the tensor's storage not resizable for good: a user's
    tensor that went through MPI could not be resized afterwards (torch's
    ``batched_powerSGD_hook`` resizes DDP's bucket and failed on "mpi").
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"host_array needs a 1-D contiguous tensor, got shape {list(flat.shape)}, {flat.stride()}")
    typestr = _TYPESTRS.get(flat.dtype)
    if typestr is None:
        typestr = _TYPESTRS[flat.dtype] = torch.empty(0, dtype=flat.dtype).numpy().dtype.str
    if flat.numel() == 0:
        return np.empty(0, dtype=typestr)
    return np.asarray(_TensorMemory(flat, typestr))


def mpi_datatype(MPI, dtype: torch.dtype):
    """Return MPI's predefined datatype for ``dtype``'s elements (the one mpi4py infers from a numpy array)."""
    datatype = _DATATYPES.get(dtype)
    if datatype is None:
        datatype = _DATATYPES[dtype] = MPI.Datatype.fromcode(np.dtype(DTYPES[dtype].numpy).char)
    return datatype
