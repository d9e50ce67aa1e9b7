"""The mpi backend's ``_into`` collectives: torch.distributed's forms, where every rank sized its outputs.

Nothing is exchanged before the data (``hpcddp.comm.names``): the agreement compares the
shapes, and the transfer is one MPI call of equal blocks (allgather, gather, scatter,
reduce-scatter), or of counts that every rank first checks against its peers' (alltoall).
Mixed into MPICommunicator and run by its Engine like every other collective; the torch
backend (``hpcddp.torch_backend``) plans them, and hpcddp's API may too.
"""

from __future__ import annotations

import torch

from ._mpi_buffers import (
    bytes_view,
    displacements,
    layout_error,
    mpi_buffer,
    result_buffer,
    row_bytes,
    staged,
    write_back,
)
from .agreement import CollectiveMismatchError
from .base import ReduceOp
from .engine import Collective
from .reduction import check_reducible, divide_average_, mpi_op

__all__ = ["IntoOps"]


def _not_run() -> None:
    raise AssertionError("a collective with an argument error reached the runner")  # the agreement raises first


def _listed(tensors) -> list[torch.Tensor]:
    return tensors if isinstance(tensors, list) else [tensors]


def _write_parts(outputs: list[torch.Tensor], parts) -> None:
    """Copy each of ``parts`` (contiguous, in order) into the matching output."""
    for out, part in zip(outputs, parts):
        write_back(out)(part.reshape(out.shape))


def _row_bytes(tensor: torch.Tensor) -> int:
    # One row's bytes from the shape, never from numel / rows: a rank may send nothing (MoE routing).
    return row_bytes(tensor) if tensor.dim() else tensor.element_size()


def _sent(tensor, splits) -> tuple[torch.Tensor, list[int]]:
    """The bytes an alltoall sends, and how many go to each rank."""
    if isinstance(tensor, list):
        parts = [staged(t).reshape(-1).view(torch.uint8) for t in tensor]
        return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)), [p.numel() for p in parts]
    return staged(tensor).reshape(-1).view(torch.uint8), [int(n) * _row_bytes(tensor) for n in splits]


class IntoOps:
    """allgather_into, gather_into, scatter_into, reducescatter_into and alltoall_into on MPICommunicator."""

    def plan_allgather_into(self, out, tensor: torch.Tensor, *, error: str | None = None) -> Collective:
        """Return the gathering of every rank's ``tensor`` into every rank's ``out``, in rank order.

        Args:
            out: ``size`` tensors like ``tensor``, or one tensor of ``size`` times its
                elements; gathered in place when ``tensor`` is this rank's slice of a
                contiguous ``out`` (FSDP2 and Megatron gather so).
            tensor: this rank's part; the same shape and dtype on every rank.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
        """
        outs = _listed(out)
        error = error or next(filter(None, map(layout_error, outs)), None)
        call = self.call_for(None, "allgather_into", tensor, error=error)
        if error is not None:
            return Collective("allgather_into", _not_run, tensor, call)
        comm, MPI, size = self._comm, self._MPI, self.size
        if isinstance(out, list):
            source = staged(tensor)

            def body() -> list[torch.Tensor]:
                flat = torch.empty((size, *source.shape), dtype=source.dtype)
                comm.Allgather(bytes_view(source), bytes_view(flat))
                _write_parts(out, flat)
                return out

            return Collective("allgather_into", body, tensor, call)
        buffer, write = result_buffer(out)
        nbytes = tensor.numel() * tensor.element_size()
        in_place = (
            out.is_contiguous() and tensor.is_contiguous() and tensor.data_ptr() == out.data_ptr() + self.rank * nbytes
        )
        source = None if in_place else staged(tensor)

        def gather_into_out() -> torch.Tensor:
            comm.Allgather(MPI.IN_PLACE if in_place else bytes_view(source), bytes_view(buffer))
            if write is not None:
                write(buffer)
            return out

        return Collective("allgather_into", gather_into_out, tensor, call)

    def plan_gather_into(
        self, outs: list[torch.Tensor] | None, tensor: torch.Tensor, root: int, *, error: str | None = None
    ) -> Collective:
        """Return the gathering of every rank's ``tensor`` into root's ``outs`` (``size`` tensors like it; root only)."""
        self._check_root(root)
        outs = list(outs or []) if self.rank == root else []
        error = error or next(filter(None, map(layout_error, outs)), None)
        call = self.call_for(None, "gather_into", tensor, error=error, root=root)
        source, comm, size, is_root = staged(tensor), self._comm, self.size, self.rank == root

        def body() -> list[torch.Tensor]:
            flat = torch.empty((size, *source.shape), dtype=source.dtype) if is_root else None
            comm.Gather(bytes_view(source), None if flat is None else bytes_view(flat), root=root)
            if flat is not None:
                _write_parts(outs, flat)
            return outs

        return Collective("gather_into", _not_run if error else body, tensor, call)

    def plan_scatter_into(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, error: str | None = None
    ) -> Collective:
        """Return the scattering of root's ``chunks`` (``size`` tensors like ``out``; root only) into every rank's ``out``."""
        self._check_root(root)
        error = error or layout_error(out)
        call = self.call_for(None, "scatter_into", out, error=error, root=root)
        (buffer, write), comm, is_root = result_buffer(out), self._comm, self.rank == root

        def body() -> torch.Tensor:
            flat = torch.stack([c.detach().cpu() for c in chunks]) if is_root else None
            comm.Scatter(None if flat is None else bytes_view(flat), bytes_view(buffer), root=root)
            if write is not None:
                write(buffer)
            return out

        return Collective("scatter_into", _not_run if error else body, out, call)

    def plan_reducescatter_into(self, out: torch.Tensor, source, op: ReduceOp, *, error: str | None = None):
        """Return the reduction of every rank's ``source``, each rank's block of it written into its ``out``.

        Args:
            out: this rank's block of the result.
            source: ``size`` tensors like ``out``, or one tensor of ``size`` times its elements.
            op: the reduction.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
        """
        check_reducible(out.dtype, op, "reducescatter_into")
        error = error or layout_error(out)
        call = self.call_for(None, "reducescatter_into", out, error=error, reduce_op=op)
        if error is not None:
            return Collective("reducescatter_into", _not_run, out, call)
        flat = torch.stack([c.detach().cpu() for c in source]) if isinstance(source, list) else staged(source)
        (buffer, write), comm, MPI, size = result_buffer(out), self._comm, self._MPI, self.size
        reduce = mpi_op(MPI, out.dtype, op)

        def body() -> torch.Tensor:
            comm.Reduce_scatter_block(mpi_buffer(MPI, flat.contiguous()), mpi_buffer(MPI, buffer), op=reduce)
            divide_average_(buffer, op, size)
            if write is not None:
                write(buffer)
            return out

        return Collective("reducescatter_into", body, out, call)

    def plan_alltoall_into(self, out, tensor, out_splits=None, in_splits=None, *, error: str | None = None):
        """Return the exchange that sends this rank's parts to every rank and receives theirs into ``out``.

        Every rank's byte counts are checked against its peers' before anything moves
        (CollectiveMismatchError on every rank).

        Args:
            out: the parts received, in rank order: a list of tensors, or one tensor
                whose first dimension ``out_splits`` divides (rows from each rank).
            tensor: the parts sent, likewise (``in_splits``); its dtype and the shape
                after the first dimension agree across ranks.
            out_splits: rows from each rank when ``out`` is one tensor.
            in_splits: rows to each rank when ``tensor`` is one tensor.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
        """
        error = error or next(filter(None, map(layout_error, _listed(out))), None)
        model = tensor if isinstance(tensor, torch.Tensor) else (tensor[0] if tensor else None)
        if model is not None and model.dim() == 0:
            model = model.reshape(1, -1)
        call = self.call_for(None, "alltoall_into", model, error=error)
        if error is not None:
            return Collective("alltoall_into", _not_run, model, call)
        send, send_counts = _sent(tensor, in_splits)
        if isinstance(out, list):
            recv_counts = [t.numel() * t.element_size() for t in out]
            buffer, write = torch.empty(sum(recv_counts), dtype=torch.uint8), None
        else:
            recv_counts = [int(n) * _row_bytes(out) for n in out_splits]
            buffer, write = result_buffer(out)
        comm, MPI, ranks = self._comm, self._MPI, self.global_ranks

        def body():
            # What rank i sends to rank j must be what rank j expects from rank i.
            every = comm.allgather((send_counts, recv_counts))
            wrong = [
                f"rank {ranks[i]} sends {sends[j]} bytes to rank {ranks[j]}, which expects {every[j][1][i]}"
                for i, (sends, _) in enumerate(every)
                for j in range(len(every))
                if sends[j] != every[j][1][i]
            ]
            if wrong:
                raise CollectiveMismatchError(
                    f"alltoall_into: split sizes disagree ({'; '.join(wrong)}); nothing was transferred"
                )
            comm.Alltoallv(
                [bytes_view(send), send_counts, displacements(send_counts), MPI.BYTE],
                [bytes_view(buffer), recv_counts, displacements(recv_counts), MPI.BYTE],
            )
            if isinstance(out, list):
                _write_parts(out, (p.view(o.dtype) for o, p in zip(out, torch.split(buffer, recv_counts))))
            elif write is not None:
                write(buffer)
            return out

        return Collective("alltoall_into", body, model, call)
