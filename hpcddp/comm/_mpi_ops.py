"""The mpi backend's rooted and vector collectives (reduce, gather, scatter, reducescatter,
alltoall); mixed into MPICommunicator, run by its Engine like every other collective."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._mpi_buffers import bytes_view, displacements, layout_error, mpi_buffer, result_buffer, row_bytes, staged
from .base import Handle, ReduceOp, alltoall_splits, as_splits, even_splits, splits_error
from .engine import Collective
from .reduction import check_reducible, divide_average_, mpi_op

__all__ = ["VectorOps"]


def _run_each(bodies: list[Callable[[], Any]], result: Any) -> Callable[[], Any]:
    def body() -> Any:
        for run in bodies:
            run()
        return result

    return body


class VectorOps:
    """reduce/gather/scatter/reducescatter/alltoall on top of MPICommunicator's engine."""

    def _check_root(self, root: int) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in [0, {self.size}), got {root!r}")

    def reduce_async_(self, tensor: torch.Tensor, op: ReduceOp, root: int, *, check: str | None = None) -> Handle:
        return self.start(self.plan_reduce(tensor, op, root, check=check))

    def plan_reduce(self, tensors, op: ReduceOp, root: int, *, check: str | None = None, error: str | None = None):
        """Return the reduction of ``tensors`` (a tensor or a list: one operation) onto root's."""
        self._check_root(root)
        make = functools.partial(self.reduce_body, op=op, root=root)
        return self.plan_each("reduce", tensors, make, check=check, error=error, root=root, reduce_op=op)

    def plan_each(self, name: str, tensors, make_body, *, check, error, **fields) -> Collective:
        """Return one collective over ``tensors`` (a tensor, or a list: one operation, one agreement).

        Args:
            name: the collective (``hpcddp.comm.names``).
            tensors: its tensor or tensors; the result is this argument.
            make_body: the runner's work for one tensor.
            check: the tensor's name, for messages.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
            fields: more for the agreement (root, reduce_op).
        """
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        error = error or next(filter(None, map(layout_error, listed)), None)
        call = self.call_for(check, name, listed, error=error, **fields)
        bodies = [] if error else [make_body(t) for t in listed]
        body = bodies[0] if len(bodies) == 1 and listed[0] is tensors else _run_each(bodies, tensors)
        return Collective(name, body, listed[0] if listed else None, call)

    def reduce_body(self, tensor: torch.Tensor, op: ReduceOp, root: int):
        """Return the runner's work for reducing ``tensor`` onto ``root`` (the others' tensors stay)."""
        self._check_root(root)
        check_reducible(tensor.dtype, op, "reduce")
        buf, write = result_buffer(tensor)
        spec, reduce, comm, MPI = mpi_buffer(self._MPI, buf), mpi_op(self._MPI, tensor.dtype, op), self._comm, self._MPI
        is_root = self.rank == root

        def body() -> torch.Tensor:
            if not is_root:
                comm.Reduce(spec, None, op=reduce, root=root)
                return tensor
            comm.Reduce(MPI.IN_PLACE, spec, op=reduce, root=root)
            divide_average_(buf, op, self.size)
            if write is not None:
                write(buf)
            return tensor

        return body

    def gather_async(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        self._check_root(root)
        source = tensor.detach().cpu().contiguous()
        if source.dim() == 0:
            source = source.reshape(1)
        call = self.call_for(check, "gather", source, root=root)
        comm, MPI = self._comm, self._MPI

        def body() -> torch.Tensor | None:
            rows = comm.gather(source.shape[0], root=root)
            if self.rank != root:
                comm.Gatherv(bytes_view(source), None, root=root)
                return None
            out = torch.empty((sum(rows), *source.shape[1:]), dtype=source.dtype)
            counts = [r * row_bytes(source) for r in rows]
            comm.Gatherv(bytes_view(source), [bytes_view(out), counts, displacements(counts), MPI.BYTE], root=root)
            return out.to(tensor.device)

        return self.start(Collective("gather", body, tensor, call))

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
        # The root's errors are reported by every rank (below), so nothing is raised here.
        call = self.call_for(check, "scatter", out, root=root)
        target = staged(out)
        nbytes = target.numel() * target.element_size()
        comm, MPI, engine = self._comm, self._MPI, self.engine

        def body() -> torch.Tensor:
            # The root's sizes first, so that a wrong-sized ``out`` is an error, not a half-filled tensor.
            sizes = comm.scatter(counts or [None] * self.size if self.rank == root else None, root=root)
            if sizes is None:
                mismatch = error or "the root's chunks are invalid"
            else:
                mismatch = None if sizes == nbytes else f"out holds {nbytes} bytes but root sends {sizes}"
            if call is not None:
                engine.agreement.agree(call._replace(error=mismatch))
            elif sizes is None:
                raise ValueError(f"scatter was not run: {mismatch}")
            receive = target if mismatch is None else torch.empty(sizes, dtype=torch.uint8)
            sendspec = None if send is None else [bytes_view(send), counts, displacements(counts), MPI.BYTE]
            comm.Scatterv(sendspec, bytes_view(receive), root=root)
            if mismatch is not None:
                raise ValueError(f"scatter: {mismatch}: pass an out tensor the size of chunks[{self.rank}]")
            if target is not out:
                with torch.no_grad():
                    out.copy_(target)
            return out

        # Agreed twice: on the call before any MPI call (rule 4: another API's collective on
        # a rank fails cleanly), and inside the body on the sizes the root sent.
        return self.start(Collective("scatter", body, out, call))

    def reducescatter_async(
        self, tensor: torch.Tensor, op: ReduceOp, splits: list[int] | None = None, *, check: str | None = None
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")
        check_reducible(tensor.dtype, op, "reducescatter")
        rows = tensor.shape[0]
        splits = even_splits(rows, self.size) if splits is None else as_splits(splits)
        error = splits_error(splits, rows, self.size)
        call = self.call_for(check, "reducescatter", tensor, reduce_op=op, splits=splits, error=error)
        buf = staged(tensor)
        row_numel = int(np.prod(tensor.shape[1:], dtype=np.int64))
        out = torch.empty((splits[self.rank], *tensor.shape[1:]), dtype=tensor.dtype) if error is None else None
        counts = [int(s) * row_numel for s in splits] if error is None else None
        comm, MPI, reduce = self._comm, self._MPI, mpi_op(self._MPI, tensor.dtype, op)

        def body() -> torch.Tensor:
            comm.Reduce_scatter(mpi_buffer(MPI, buf), mpi_buffer(MPI, out), counts, op=reduce)
            divide_average_(out, op, self.size)
            return out.to(tensor.device)

        return self.start(Collective("reducescatter", body, tensor, call))

    def alltoall_async(
        self, tensor: torch.Tensor, splits: list[int] | None = None, *, check: str | None = None
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
        source = tensor.detach().cpu().contiguous()
        rows = source.shape[0]
        splits, error = alltoall_splits(splits, rows, self.size)
        call = self.call_for(check, "alltoall", source, error=error)
        comm, MPI = self._comm, self._MPI

        def body():
            sent_rows = np.array(splits, dtype=np.int64)
            received_rows = np.empty(self.size, dtype=np.int64)
            comm.Alltoall(sent_rows, received_rows)
            out = torch.empty((int(received_rows.sum()), *source.shape[1:]), dtype=source.dtype)
            size = row_bytes(source)
            send_counts = [int(r) * size for r in sent_rows]
            recv_counts = [int(r) * size for r in received_rows]
            comm.Alltoallv(
                [bytes_view(source), send_counts, displacements(send_counts), MPI.BYTE],
                [bytes_view(out), recv_counts, displacements(recv_counts), MPI.BYTE],
            )
            return out.to(tensor.device), torch.from_numpy(received_rows)

        return self.start(Collective("alltoall", body, tensor, call))
