"""The collectives where ranks exchange different parts: gather, scatter, reduce-scatter, all-to-all."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm._mpi_buffers import displacements, row_bytes
from ..comm.agreement import CollectiveMismatchError
from ..comm.base import ReduceOp
from ._buffers import describe, reduce_op_of, stage, unstage

__all__ = ["ExchangeCollectives"]


def _like(argument: str, tensors: list[torch.Tensor], model: torch.Tensor, size: int) -> str | None:
    if len(tensors) != size:
        return f"{argument} must hold world_size={size} tensors, got {len(tensors)}"
    for t in tensors:
        if t.shape != model.shape or t.dtype != model.dtype:
            return f"{argument} must hold tensors like {describe([model])}, got {describe([t])}"
    return None


def _bytes(tensor: torch.Tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy()


class ExchangeCollectives:
    """Mixin of ``ProcessGroupHPCDDP``: gather, scatter, reduce_scatter(_single), alltoall(_single)."""

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        root, source = opts.rootRank if opts is not None else 0, inputs[0]
        outputs = output_lists[0] if self.rank() == root else []
        error = _like("gather_list", outputs, source, self.size()) if self.rank() == root else None
        staged, comm, rank = stage(source), self._mpi, self.rank()

        def body():
            flat = torch.empty((self.size(), *staged.shape), dtype=staged.dtype) if rank == root else None
            comm.Gather(_bytes(staged), None if flat is None else _bytes(flat), root=root)
            for out, part in zip(outputs, flat if flat is not None else []):
                unstage(out, part)
            return output_lists

        return self._start("gather_list", body, [source], opts, error=error, root=root)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        root, target = opts.rootRank if opts is not None else 0, outputs[0]
        chunks = input_lists[0] if self.rank() == root else []
        error = _like("scatter_list", chunks, target, self.size()) if self.rank() == root else None
        staged, comm, rank = stage(target), self._mpi, self.rank()

        def body():
            flat = torch.stack([c.detach().cpu() for c in chunks]) if rank == root else None
            comm.Scatter(None if flat is None else _bytes(flat), _bytes(staged), root=root)
            return [unstage(target, staged)]

        return self._start("scatter_list", body, [target], opts, error=error, root=root)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        target, chunks = outputs[0], input_lists[0]
        error = _like("input_list", chunks, target, self.size())
        flat = torch.stack([c.detach().cpu() for c in chunks]) if error is None else None
        return self._reduce_scatter("reduce_scatter", target, flat, opts, error)

    def reduce_scatter_single(self, output: torch.Tensor, source: torch.Tensor, opts=None):
        error = None
        if source.numel() != output.numel() * self.size() or source.dtype != output.dtype:
            error = (
                f"input must hold world_size x output ({self.size()} x {describe([output])}), got {describe([source])}"
            )
        return self._reduce_scatter("reduce_scatter_tensor", output, stage(source), opts, error)

    def _reduce_scatter_base(self, output, source, opts=None):
        return self.reduce_scatter_single(output, source, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._sequence([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(self, collective, target, flat, opts, error):
        op = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        hpcddp_comm = self._comm
        hpcddp_comm._ops.check_reducible(target.dtype, op, collective)
        error = error or hpcddp_comm.layout_error(target)
        staged, comm, size = stage(target), self._mpi, self.size()
        mpi_op = hpcddp_comm._ops.op(target.dtype, op)

        def body():
            send = hpcddp_comm._ops.buffer(flat.contiguous())
            comm.Reduce_scatter_block(send, hpcddp_comm._ops.buffer(staged), op=mpi_op)
            if op is ReduceOp.AVERAGE:
                staged.div_(size)
            return [unstage(target, staged)]

        return self._start(collective, body, [target], opts, error=error, reduce_op=op)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        error = None
        if len(outputs) != self.size() or len(inputs) != self.size():
            error = f"all_to_all needs world_size={self.size()} input and output tensors, got {len(inputs)} and {len(outputs)}"
        elif len({t.dtype for t in (*outputs, *inputs)}) > 1:
            error = f"all_to_all needs one dtype for inputs and outputs, got {describe(inputs)} -> {describe(outputs)}"
        staged_in = [stage(t) for t in inputs]
        send = torch.cat([t.reshape(-1).view(torch.uint8) for t in staged_in]) if staged_in else None
        send_counts = [t.numel() * t.element_size() for t in inputs]
        recv_counts = [t.numel() * t.element_size() for t in outputs]

        def unpack(flat):
            for out, part in zip(outputs, torch.split(flat, recv_counts)):
                unstage(out, part.view(out.dtype).reshape(out.shape))
            return outputs

        return self._alltoallv(
            "all_to_all", inputs[0] if inputs else None, send, send_counts, recv_counts, unpack, opts, error
        )

    def all_to_all_single(self, output, source, output_splits, input_splits, opts=None):
        size, error = self.size(), None
        rows_in, rows_out = (source.shape[0] if source.dim() else 1), (output.shape[0] if output.dim() else 1)
        input_splits = list(input_splits) or [rows_in // size] * size
        output_splits = list(output_splits) or [rows_out // size] * size
        # One row's bytes from the shape, never from numel / rows: a rank may send nothing (MoE routing).
        row = row_bytes(source) if source.dim() else source.element_size()
        if len(input_splits) != size or len(output_splits) != size:
            error = f"split sizes must list world_size={size} entries, got {input_splits} and {output_splits}"
        elif sum(input_splits) != rows_in or sum(output_splits) != rows_out:
            error = f"split sizes {input_splits} -> {output_splits} do not add up to the rows of {describe([source])} -> {describe([output])}"
        elif source.dtype != output.dtype or source.shape[1:] != output.shape[1:]:
            error = f"input and output must differ only in dim 0, got {describe([source])} -> {describe([output])}"
        staged_out = stage(output)

        def unpack(flat):
            staged_out.reshape(-1).view(torch.uint8).copy_(flat)
            return [unstage(output, staged_out)]

        send = stage(source).reshape(-1).view(torch.uint8)
        send_counts = [n * row for n in input_splits]
        recv_counts = [n * row for n in output_splits]
        return self._alltoallv("all_to_all_single", source, send, send_counts, recv_counts, unpack, opts, error)

    alltoall_base = all_to_all_single

    def _alltoallv(self, collective, model, send, send_counts, recv_counts, unpack, opts, error):
        comm, MPI, ranks = self._mpi, self._MPI, self._global_ranks

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
                    f"{collective}: split sizes disagree ({'; '.join(wrong)}); nothing was transferred"
                )
            recv = torch.empty(sum(recv_counts), dtype=torch.uint8)
            comm.Alltoallv(
                [send.numpy(), send_counts, displacements(send_counts), MPI.BYTE],
                [recv.numpy(), recv_counts, displacements(recv_counts), MPI.BYTE],
            )
            return unpack(recv)

        # Rows may differ between ranks: the agreement compares dtype and row shape only.
        rows = [] if model is None else [model.reshape(1, -1) if model.dim() == 0 else model]
        return self._start(collective, body, rows, opts, error=error, rows_may_differ=True)
