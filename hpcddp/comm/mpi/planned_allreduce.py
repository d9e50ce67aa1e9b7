"""In-place allreduces planned once per signature: the latency path of ``allreduce_`` and torch's ``all_reduce``.

A small allreduce's time was mostly Python's: planning it (the agreement's call, the
log's descriptor, the MPI datatype and op, a numpy view of the tensor) took 12-16 us
where MPI's own Allreduce of 8 floats takes about 2 us here, and 20-25 us of a 1 MiB
allreduce's 240. A training loop's reductions (a loss, a metric, a count, a buffer
averaged each step) repeat the same few signatures, so their plans are made once and
kept. Every in-place allreduce of a contiguous CPU tensor of MPI's own dtypes takes this
path, up to the two-level allreduce's threshold on a hierarchical communicator (from
there on the general path's two steps) and up to one MPI message otherwise. The MPI
calls are the general path's exactly (the agreement, then ``Allreduce(IN_PLACE, ...)``
of the same count and datatype), so a rank on this path and a rank on the general one
(a non-contiguous tensor of the same shape) still pair, and a mismatch still raises on
every rank. A training step's gradient buckets (a step set) keep one plan per bucket
signature too; each launch only writes its label and step into the plan's descriptor and
agreement call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from .. import oplog
from ..agreement import CollectiveCall
from ..base import MESSAGE_PIECE_BYTES
from ..dtypes import DTYPES, dtype_name, mpi_datatype
from ..reduction import ReduceOp, check_reducible, divide_average_, mpi_op
from .agreeing import Agreement
from .engine import Collective
from .hierarchy import HIERARCHY_MIN_BYTES

__all__ = ["PlannedAllreduces"]
#: signatures kept per communicator (a loop has a handful; a stream of new shapes starts over)
_MAX_PLANS = 256


class _Plan(NamedTuple):
    desc: oplog.Descriptor
    call: CollectiveCall | None
    count: int
    nbytes: int
    datatype: Any
    reduce: Any
    average: bool


class PlannedAllreduces:
    """The in-place allreduces of contiguous CPU tensors of one communicator, planned once per signature.

    Args:
        comm: the mpi4py communicator the collectives run on.
        MPI: the mpi4py ``MPI`` module.
        call_for: the communicator's ``call_for`` (what the ranks agree on, None with checks off).
        agreement: the communicator's agreement (whether it runs now is part of a plan's key).
        hierarchical: the communicator's allreduces go two-level from ``HIERARCHY_MIN_BYTES`` on.
    """

    def __init__(
        self, comm, MPI, call_for: Callable[..., CollectiveCall | None], agreement: Agreement, hierarchical: bool
    ) -> None:
        self._comm, self._MPI = comm, MPI
        #: tensors below this size take the planned path: always one flat ``Allreduce``, as on the general path
        self.max_bytes = HIERARCHY_MIN_BYTES if hierarchical else MESSAGE_PIECE_BYTES
        self._size = comm.Get_size()
        self._call_for = call_for
        self._agreement = agreement
        self._plans: dict[tuple, _Plan | None] = {}

    def plan(
        self, tensors, op: ReduceOp, check: str | None, *, label: str = "", step: int | None = None
    ) -> Collective | None:
        """Return the allreduce of ``tensors`` (one tensor, or a list of one), planned, or None when it cannot be.

        Args:
            tensors: what to reduce in place; the collective's result is this argument.
            op: the reduction.
            check: the tensor's name, for messages.
            label: what it is for (stall reports).
            step: the training step it belongs to, compared across ranks.
        """
        if tensors.__class__ is list:
            if len(tensors) != 1:
                return None
            tensor = tensors[0]
        else:
            tensor = tensors
        if not (tensor.is_cpu and tensor.is_contiguous()):
            return None
        # Everything the descriptor and the agreement's call depend on: a new label, patience (a
        # checkpoint's wait) or checks switched is a new plan. A bucket's label and step change every
        # step: its plan is kept without them, and each launch writes them into its copies.
        stepped = step is not None
        kept_label = "" if stepped else label
        key = (tensor.shape, tensor.dtype, op, check, kept_label, stepped, oplog.is_patient(), self._agreement.runs)
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._make(tensor, op, check, kept_label, key)
        if plan is None:
            return None
        oplog.mark_collective_thread()
        desc, call = plan.desc, plan.call
        if stepped:
            desc = desc.for_step(label, step)
            if call is not None:
                call = call._replace(step=step, name=check or label)
        target = tensor.detach() if tensor.requires_grad else tensor  # a parameter, reduced in place as data
        return Collective("allreduce", partial(self._reduce, plan, target, tensors), tensor, call, desc)

    def _make(self, tensor: torch.Tensor, op: ReduceOp, check: str | None, label: str, key: tuple) -> _Plan | None:
        carried = DTYPES.get(tensor.dtype)
        plan = None
        if carried is not None and carried.native and 0 < tensor.nbytes < self.max_bytes:
            check_reducible(tensor.dtype, op)
            plan = _Plan(
                oplog.describe("allreduce", tensor.shape, dtype_name(tensor.dtype), label=label),
                # A list of one, as the general path's plan_each describes it: the same fingerprint.
                self._call_for(check, "allreduce", [tensor], label=label, reduce_op=op),
                tensor.numel(),
                tensor.nbytes,
                mpi_datatype(self._MPI, tensor.dtype),
                mpi_op(self._MPI, tensor.dtype, op),
                op is ReduceOp.AVERAGE,
            )
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _reduce(self, plan: _Plan, tensor: torch.Tensor, result: Any) -> Any:
        # An address, not a numpy view: tensor.numpy() would mark the user's storage
        # not resizable for good (see dtypes.host_array), and is slower.
        memory = self._MPI.buffer.fromaddress(tensor.data_ptr(), plan.nbytes)
        self._comm.Allreduce(self._MPI.IN_PLACE, [memory, plan.count, plan.datatype], op=plan.reduce)
        if plan.average:
            divide_average_(tensor, ReduceOp.AVERAGE, self._size)
        return result
