"""The collectives where ranks exchange different parts: gather, scatter, reduce-scatter, all-to-all.

torch's arguments are checked here, naming them as torch does; the transfers are the
communicator's ``_into`` collectives (``hpcddp.comm.mpi``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..comm.mpi.p2p import describe_tensors as describe
from ..comm.reduction import from_torch

__all__ = ["ExchangeCollectives", "like"]


def like(argument: str, tensors: list[torch.Tensor], model: torch.Tensor, size: int) -> str | None:
    """What is wrong with ``tensors`` as ``size`` tensors like ``model``, naming torch's ``argument``; or None."""
    if len(tensors) != size:
        return f"{argument} must hold world_size={size} tensors, got {len(tensors)}"
    for t in tensors:
        if t.shape != model.shape or t.dtype != model.dtype:
            return f"{argument} must hold tensors like {describe([model])}, got {describe([t])}"
    return None


class ExchangeCollectives:
    """Mixin of ``ProcessGroupHPCDDP``: gather, scatter, reduce_scatter(_single), alltoall(_single)."""

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        root, source = opts.rootRank if opts is not None else 0, inputs[0]
        outputs = output_lists[0] if self.rank() == root else []
        error = like("gather_list", outputs, source, self.size()) if self.rank() == root else None
        collective = self._comm.plan_gather_into(outputs, source, root, error=error)
        return self._start(collective, opts, output_lists, event=("gather", inputs))

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        root, target = opts.rootRank if opts is not None else 0, outputs[0]
        chunks = input_lists[0] if self.rank() == root else []
        error = like("scatter_list", chunks, target, self.size()) if self.rank() == root else None
        collective = self._comm.plan_scatter_into(target, chunks, root, error=error)
        return self._start(collective, opts, [target], event=("scatter", chunks))

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        target, chunks = outputs[0], input_lists[0]
        error = like("input_list", chunks, target, self.size())
        return self._reduce_scatter(target, chunks, opts, error, ("reduce_scatter", chunks))

    def reduce_scatter_single(self, output: torch.Tensor, source: torch.Tensor, opts=None):
        error = None
        if source.numel() != output.numel() * self.size() or source.dtype != output.dtype:
            error = (
                f"input must hold world_size x output ({self.size()} x {describe([output])}), got {describe([source])}"
            )
        return self._reduce_scatter(output, source, opts, error, ("reduce_scatter_tensor", [source]))

    def _reduce_scatter_base(self, output, source, opts=None):
        return self.reduce_scatter_single(output, source, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        calls = [functools.partial(self.reduce_scatter_single, o, i, opts) for o, i in zip(outputs, inputs)]
        return self._coalesced("reduce_scatter_tensor_coalesced", inputs, calls)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(self, target, source, opts, error, event):
        op = from_torch(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        collective = self._comm.plan_reducescatter_into(target, source, op, error=error)
        return self._start(collective, opts, [target], event=event)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        error = None
        if len(outputs) != self.size() or len(inputs) != self.size():
            error = (
                f"input_tensor_list and output_tensor_list must hold world_size={self.size()} tensors each, "
                f"got {len(inputs)} and {len(outputs)}"
            )
        elif len({t.dtype for t in (*outputs, *inputs)}) > 1:
            error = f"input_tensor_list and output_tensor_list must hold one dtype, got {describe(inputs)} -> {describe(outputs)}"
        return self._start(
            self._comm.plan_alltoall_into(outputs, inputs, error=error), opts, event=("all_to_all", inputs)
        )

    def all_to_all_single(self, output, source, output_splits, input_splits, opts=None):
        size, error = self.size(), None
        rows_in, rows_out = (source.shape[0] if source.dim() else 1), (output.shape[0] if output.dim() else 1)
        input_splits = list(input_splits) or [rows_in // size] * size
        output_splits = list(output_splits) or [rows_out // size] * size
        if len(input_splits) != size or len(output_splits) != size:
            error = f"split sizes must list world_size={size} entries, got {input_splits} and {output_splits}"
        elif sum(input_splits) != rows_in or sum(output_splits) != rows_out:
            error = f"split sizes {input_splits} -> {output_splits} do not add up to the rows of {describe([source])} -> {describe([output])}"
        elif source.dtype != output.dtype or source.shape[1:] != output.shape[1:]:
            error = f"input and output must differ only in dim 0, got {describe([source])} -> {describe([output])}"
        collective = self._comm.plan_alltoall_into(output, source, output_splits, input_splits, error=error)
        return self._start(collective, opts, [output], event=("all_to_all", [source]))

    alltoall_base = all_to_all_single
