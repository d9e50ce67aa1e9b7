"""The mpi backend's rooted and vector collectives (reduce, gather, scatter, reducescatter,
alltoall) and its point-to-point messages; mixed into MPICommunicator."""

from __future__ import annotations

import time

import numpy as np
import torch

from ._mpi_buffers import bytes_view, staged
from .base import Handle, ReduceOp, alltoall_splits, as_splits, even_splits, splits_error

__all__ = ["RequestHandle", "VectorOps"]


def _row_bytes(tensor: torch.Tensor) -> int:
    return int(np.prod(tensor.shape[1:], dtype=np.int64)) * tensor.element_size()


def _displacements(counts: list[int]) -> list[int]:
    return np.cumsum([0, *counts[:-1]]).tolist()


class RequestHandle(Handle):
    """A Handle over an MPI request; waiting tests it from the waiting thread (the comm thread never blocks on it).

    Args:
        request: the mpi4py request.
        result: what ``wait`` returns.
        expected_bytes: for a receive, the size the message must have.
    """

    def __init__(self, MPI, request, result, name: str, expected_bytes: int | None = None) -> None:
        super().__init__(name)
        self._MPI, self._request, self._pending_result = MPI, request, result
        self._expected = expected_bytes

    def poll(self) -> bool:
        return self._done.is_set() or self._test(None)

    def _test(self, status) -> bool:
        try:
            return self._request.Test(status)
        except self._MPI.Exception as err:  # a message longer than the receiving tensor
            self._request = self._MPI.REQUEST_NULL
            self.set_exception(ValueError(f"{self.name} failed ({err}): pass a tensor of the sent message's size"))
            return True

    def _block(self, timeout: float | None) -> bool:
        if self._done.is_set():
            return True
        status = self._MPI.Status()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._test(status):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(1e-4)
        if self._done.is_set():
            return True
        received = status.Get_count(self._MPI.BYTE)
        if self._expected is not None and received != self._expected:
            self.set_exception(
                ValueError(
                    f"{self.name} received {received} bytes into a tensor of {self._expected} bytes: "
                    "pass a tensor of the sent message's shape and dtype"
                )  # fmt: skip
            )
        else:
            self.set_result(self._pending_result)
        return True


class VectorOps:
    """reduce/gather/scatter/reducescatter/alltoall/send/recv on top of MPICommunicator's queue."""

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in [0, {self.size}), got {root}")

    def reduce_async_(self, tensor: torch.Tensor, op: ReduceOp, root: int, *, check: str | None = None) -> Handle:
        self._check_root(root)
        self._ops.check_reducible(tensor.dtype, op, "reduce")
        sig = self._checked(check, "reduce", tensor, root=root, reduce_op=op)
        buf = staged(tensor)
        spec, mpi_op, comm, MPI = self._ops.buffer(buf), self._ops.op(tensor.dtype, op), self._comm, self._MPI
        is_root = self.rank == root

        def work():
            if is_root:
                comm.Reduce(MPI.IN_PLACE, spec, op=mpi_op, root=root)
            else:
                comm.Reduce(spec, None, op=mpi_op, root=root)
            return buf

        def finish(out: torch.Tensor) -> torch.Tensor:
            if not is_root:
                return tensor
            if op is ReduceOp.AVERAGE:
                out.div_(self.size)
            return out if out is tensor else tensor.copy_(out)

        return self._submit(work, "reduce", tensor, sig=sig).then(finish)

    def gather_async(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        self._check_root(root)
        source = tensor.detach().cpu().contiguous()
        if source.dim() == 0:
            source = source.reshape(1)
        sig = self._checked(check, "gather", source, rows_may_differ=True, root=root)
        comm, MPI = self._comm, self._MPI

        def work():
            rows = comm.gather(source.shape[0], root=root)
            if self.rank != root:
                comm.Gatherv(bytes_view(source), None, root=root)
                return None
            out = torch.empty((sum(rows), *source.shape[1:]), dtype=source.dtype)
            counts = [r * _row_bytes(source) for r in rows]
            comm.Gatherv(bytes_view(source), [bytes_view(out), counts, _displacements(counts), MPI.BYTE], root=root)
            return out

        return self._submit(work, "gather", tensor, sig=sig).then(
            lambda out: None if out is None else out.to(tensor.device)
        )

    def scatter_async_(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, check: str | None = None
    ) -> Handle:
        self._check_root(root)
        error = send = counts = None
        if self.rank == root:
            if chunks is None or len(chunks) != self.size:
                length = "None" if chunks is None else f"{len(chunks)} tensors"
                error = f"chunks must be a list of {self.size} tensors on the root, got {length}"
            elif any(c.dtype != out.dtype for c in chunks):
                error = f"chunks must have out's dtype {out.dtype}, got {sorted({str(c.dtype) for c in chunks})}"
            else:
                send = torch.cat([c.detach().cpu().reshape(-1) for c in chunks])
                counts = [c.numel() * c.element_size() for c in chunks]
        checking = self._checking(check)
        # Root's errors are reported by every rank (below), so nothing is raised here.
        sig = self._checked(check, "scatter", out, rows_may_differ=True, root=root)
        target = staged(out)
        nbytes = target.numel() * target.element_size()
        comm, MPI = self._comm, self._MPI

        def work():
            # Root's sizes first, so that a wrong-sized ``out`` is an error, not a half-filled tensor.
            sizes = comm.scatter(counts or [None] * self.size if self.rank == root else None, root=root)
            if sizes is None:
                mismatch = error or "the root's chunks are invalid"
            else:
                mismatch = None if sizes == nbytes else f"out holds {nbytes} bytes but root sends {sizes}"
            if checking:
                self._agree(sig._replace(error=mismatch))
            elif sizes is None:
                raise ValueError(f"scatter was not run: {mismatch}")
            receive = target if mismatch is None else torch.empty(sizes, dtype=torch.uint8)
            sendspec = None if send is None else [bytes_view(send), counts, _displacements(counts), MPI.BYTE]
            comm.Scatterv(sendspec, bytes_view(receive), root=root)
            if mismatch is not None:
                raise ValueError(f"scatter: {mismatch}: pass an out tensor the size of chunks[{self.rank}]")
            return target

        handle = self._submit(work, "scatter", out)
        return handle.then(lambda res: res if res is out else out.copy_(res))

    def reducescatter_async(
        self, tensor: torch.Tensor, op: ReduceOp, splits: list[int] | None = None, *, check: str | None = None
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")
        self._ops.check_reducible(tensor.dtype, op, "reducescatter")
        rows = tensor.shape[0]
        splits = even_splits(rows, self.size) if splits is None else as_splits(splits)
        error = splits_error(splits, rows, self.size)
        sig = self._checked(check, "reducescatter", tensor, reduce_op=op, splits=splits, error=error)
        buf = staged(tensor)
        row_numel = int(np.prod(tensor.shape[1:], dtype=np.int64))
        out = torch.empty((splits[self.rank], *tensor.shape[1:]), dtype=tensor.dtype) if error is None else None
        counts = [int(s) * row_numel for s in splits] if error is None else None
        comm, mpi_op = self._comm, self._ops.op(tensor.dtype, op)

        def work():
            comm.Reduce_scatter(self._ops.buffer(buf), self._ops.buffer(out), counts, op=mpi_op)
            return out

        handle = self._submit(work, "reducescatter", tensor, sig=sig)
        if op is ReduceOp.AVERAGE:
            handle.then(lambda res: res.div_(self.size))
        return handle.then(lambda res: res.to(tensor.device))

    def alltoall_async(
        self, tensor: torch.Tensor, splits: list[int] | None = None, *, check: str | None = None
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
        source = tensor.detach().cpu().contiguous()
        rows = source.shape[0]
        splits, error = alltoall_splits(splits, rows, self.size)
        sig = self._checked(check, "alltoall", source, rows_may_differ=True, error=error)
        comm, MPI = self._comm, self._MPI

        def work():
            sent_rows = np.array(splits, dtype=np.int64)
            received_rows = np.empty(self.size, dtype=np.int64)
            comm.Alltoall(sent_rows, received_rows)
            out = torch.empty((int(received_rows.sum()), *source.shape[1:]), dtype=source.dtype)
            row_bytes = _row_bytes(source)
            send_counts = [int(r) * row_bytes for r in sent_rows]
            recv_counts = [int(r) * row_bytes for r in received_rows]
            comm.Alltoallv(
                [bytes_view(source), send_counts, _displacements(send_counts), MPI.BYTE],
                [bytes_view(out), recv_counts, _displacements(recv_counts), MPI.BYTE],
            )
            return out, torch.from_numpy(received_rows)

        handle = self._submit(work, "alltoall", tensor, sig=sig)
        return handle.then(lambda res: (res[0].to(tensor.device), res[1]))

    def _check_peer(self, peer: int, argument: str) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{argument} must be a rank in [0, {self.size}), got {peer}")

    def send_async(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        self._check_peer(dest, "dest")
        buf = staged(tensor.detach())
        request = self._comm.Isend(bytes_view(buf), dest=dest, tag=tag)
        return RequestHandle(self._MPI, request, tensor, "send")

    def recv_async_(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Handle:
        self._check_peer(source, "source")
        buf = staged(tensor.detach())
        request = self._comm.Irecv(bytes_view(buf), source=source, tag=tag)
        nbytes = buf.numel() * buf.element_size()
        handle = RequestHandle(self._MPI, request, buf, "recv", expected_bytes=nbytes)
        return handle.then(
            lambda out: tensor if out is tensor or out.data_ptr() == tensor.data_ptr() else tensor.copy_(out)
        )
