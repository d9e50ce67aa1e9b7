"""Torch tensors as MPI buffers: staging through host memory, writing results back, pieces MPI can count."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base import MESSAGE_PIECE_BYTES
from ..dtypes import DTYPES, host_array, mpi_datatype, numpy_view

__all__ = [
    "bytes_view",
    "displacements",
    "empty_like",
    "explain_failure",
    "for_each_piece",
    "layout_error",
    "mpi_buffer",
    "result_buffer",
    "result_buffer_async",
    "row_bytes",
    "staged",
    "staged_async",
    "write_back",
]


def bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """Return a contiguous CPU tensor's memory as a flat uint8 array (no copy)."""
    return host_array(tensor.reshape(-1).view(torch.uint8))


def staged(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` itself when MPI can use its memory (CPU, contiguous), else a contiguous CPU copy.

    A GPU tensor is copied into pinned memory (DMA at full speed; pageable memory takes a
    bounce through a driver buffer), waiting for the copy.
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach() if tensor.requires_grad else tensor
    if tensor.is_cuda:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor.detach())
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def staged_async(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Return (``staged(tensor)``, None), or for a GPU tensor (a pinned host copy still in flight, its event).

    The copy is queued on the caller's current stream, after the kernels that wrote the
    tensor, and the caller goes on at once (backward keeps computing while a bucket is
    copied out): whoever reads the host copy calls ``event.synchronize()`` first, on the
    thread that runs the collective (issue 34, item 11).
    """
    if not tensor.is_cuda:
        return staged(tensor), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))
    return host, ready


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


def layout_error(tensor: torch.Tensor) -> str | None:
    """What is wrong with writing a collective's result into ``tensor``, or None.

    An ``expand()``ed tensor is written through its un-expanded view (``write_back``),
    as gloo does; other views whose elements share memory cannot take one result each.
    """
    if torch._debug_has_internal_overlap(tensor) == 1 and write_back(tensor) is None:
        return (
            f"the tensor (shape {list(tensor.shape)}, strides {list(tensor.stride())}) has elements that share "
            "memory (expand(), broadcast views): a collective cannot write one result per element; "
            "pass tensor.contiguous()"
        )
    return None


def result_buffer(tensor: torch.Tensor):
    """The buffer MPI writes ``tensor``'s result into, and ``write(buffer)`` to copy it back (None: it is ``tensor``)."""
    buffer = staged(tensor)
    same_memory = buffer.data_ptr() == tensor.data_ptr() and buffer.device == tensor.device
    return buffer, None if same_memory else write_back(tensor)


def result_buffer_async(tensor: torch.Tensor):
    """``result_buffer`` with the staging copy of a GPU tensor in flight: (buffer, write, event or None).

    Call ``event.synchronize()`` before MPI reads the buffer (``staged_async``).
    """
    buffer, ready = staged_async(tensor)
    same_memory = buffer.data_ptr() == tensor.data_ptr() and buffer.device == tensor.device
    return buffer, None if same_memory else write_back(tensor), ready


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
    carried = DTYPES.get(tensor.dtype)
    if tensor.device.type != "cpu" or carried is None or not carried.native:
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return torch.from_numpy(np.empty(tuple(tensor.shape), dtype=carried.numpy))


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


def mpi_buffer(MPI, tensor: torch.Tensor, counts=None, displs=None) -> list:
    """Return an mpi4py buffer spec for a contiguous CPU tensor of a dtype MPI reduces (element counts, if given)."""
    data, datatype = numpy_view(tensor), mpi_datatype(MPI, tensor.dtype)
    if counts is None:
        return [data, datatype]
    return [data, counts, displs, datatype] if displs is not None else [data, counts, datatype]
