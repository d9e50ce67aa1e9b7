"""Collectives through mpi4py, run in order on one communication thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._mpi import import_mpi
from .base import Communicator, Handle, ReduceOp

__all__ = ["MPICommunicator"]

_TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
# MPI has no standard 16-bit float: these travel as 2-byte integers and are combined
# by user-defined ops that view the bytes with the right dtype.
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()


class MPICommunicator(Communicator):
    """Communicator over an MPI communicator (COMM_WORLD by default).

    Blocking MPI collectives run on a dedicated thread in submission order: Open
    MPI's blocking Allreduce moved 16 MiB 2.7x faster than its non-blocking
    Iallreduce (libnbc) here, and the thread lets it overlap the caller's compute
    while mpi4py releases the GIL. Tensors on a GPU are staged through host memory.

    Args:
        comm: an mpi4py communicator; it is duplicated, so hpcddp's traffic never
            mixes with the caller's.
    """

    name = "mpi"

    def __init__(self, comm=None) -> None:
        MPI = import_mpi()
        self._MPI = MPI
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        super().__init__(self._comm.Get_rank(), self._comm.Get_size())
        self._ops: dict[tuple[torch.dtype, ReduceOp], Any] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="hpcddp-mpi", daemon=True)
        self._thread.start()

    @property
    def mpi_comm(self):
        """The (duplicated) mpi4py communicator this backend talks on."""
        return self._comm

    # -- the communication thread ------------------------------------------------
    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, handle = item
            try:
                handle.set_result(work())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                handle.set_exception(err)

    def _submit(self, work: Callable[[], Any], name: str) -> Handle:
        handle = Handle(name)
        self._queue.put((work, handle))
        return handle

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
            self._comm.Free()

    # -- collectives ----------------------------------------------------------------
    def _mpi_op(self, dtype: torch.dtype, op: ReduceOp):
        MPI = self._MPI
        if dtype not in _HALF_DTYPES:
            return {ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}.get(op, MPI.SUM)
        key = (dtype, op)
        if key not in self._ops:
            combine = {ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}.get(op, torch.add)

            def reduce_half(inbuf, outbuf, datatype, dtype=dtype, combine=combine):
                out = torch.frombuffer(outbuf, dtype=dtype)
                combine(out, torch.frombuffer(inbuf, dtype=dtype), out=out)

            self._ops[key] = MPI.Op.Create(reduce_half, commute=True)
        return self._ops[key]

    def allreduce_async_(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        dtype = tensor.dtype
        if dtype not in _TORCH_TO_NUMPY and dtype not in _HALF_DTYPES:
            raise TypeError(f"allreduce does not support tensors of dtype {dtype}")
        if op is ReduceOp.AVERAGE and not (dtype.is_floating_point):
            raise TypeError(f"op='average' needs a floating-point tensor, got {dtype}: use op='sum'")
        staged = tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else tensor.cpu().contiguous()
        if dtype in _HALF_DTYPES:
            buffer = [staged.view(torch.int16).numpy(), self._MPI.SHORT]
        else:
            buffer = staged.numpy()
        mpi_op = self._mpi_op(dtype, op)
        comm = self._comm

        def work():
            if self.size > 1:
                comm.Allreduce(self._MPI.IN_PLACE, buffer, op=mpi_op)
            return staged

        handle = self._submit(work, "allreduce")
        if op is ReduceOp.AVERAGE:
            handle.then(lambda out: out.div_(self.size))
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def broadcast_async_(self, tensor: torch.Tensor, root: int) -> Handle:
        staged = tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else tensor.cpu().contiguous()
        raw = _bytes_view(staged)
        comm = self._comm

        def work():
            comm.Bcast(raw, root=root)
            return staged

        return self._submit(work, "broadcast").then(lambda out: out if out is tensor else tensor.copy_(out))

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        source = tensor.detach().cpu().contiguous()
        if source.dim() == 0:
            source = source.reshape(1)
        comm = self._comm

        def work():
            rows = comm.allgather(source.shape[0])
            out = torch.empty((sum(rows), *source.shape[1:]), dtype=source.dtype)
            row_bytes = int(np.prod(source.shape[1:], dtype=np.int64)) * source.element_size()
            counts = [r * row_bytes for r in rows]
            displs = np.cumsum([0, *counts[:-1]]).tolist()
            comm.Allgatherv(_bytes_view(source), [_bytes_view(out), counts, displs, self._MPI.BYTE])
            return out

        return self._submit(work, "allgather").then(lambda out: out.to(tensor.device))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self._submit(lambda: self._comm.bcast(obj, root=root), "broadcast_object").wait()

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._submit(lambda: self._comm.allgather(obj), "allgather_object").wait()

    def barrier(self) -> None:
        self._submit(self._comm.Barrier, "barrier").wait()
