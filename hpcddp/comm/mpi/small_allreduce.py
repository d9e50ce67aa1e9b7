"""Small allreduces planned once per signature: the latency path of ``allreduce_`` and torch's ``all_reduce``.

A small allreduce's time was mostly Python's: planning it (the agreement's call, the
log's descriptor, the MPI datatype and op, a numpy view of the tensor) took 12-16 us
where MPI's own Allreduce of 8 floats takes about 2 us here. A training loop's small
reductions (a loss, a metric, a count) repeat the same few signatures, so their plans
are made once and kept. The MPI calls are the general path's exactly (the agreement,
then ``Allreduce(IN_PLACE, ...)`` of the same count and datatype), so a rank on this
path and a rank on the general one (a non-contiguous tensor of the same shape) still
pair, and a mismatch still raises on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from .. import oplog
from ..agreement import CollectiveCall
from ..dtypes import DTYPES, dtype_name, mpi_datatype
from ..reduction import ReduceOp, check_reducible, divide_average_, mpi_op
from .agreeing import Agreement
from .engine import Collective
from .hierarchy import HIERARCHY_MIN_BYTES

__all__ = ["SMALL_BYTES", "SmallAllreduces"]

#: tensors below this size take the planned path: the two-level allreduce's threshold, so
#: always MPI's flat Allreduce, as the general path (which goes two-level from it on)
SMALL_BYTES = HIERARCHY_MIN_BYTES
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


class SmallAllreduces:
    """The in-place allreduces of small contiguous CPU tensors of one communicator, planned once per signature.

    Args:
        comm: the mpi4py communicator the collectives run on.
        MPI: the mpi4py ``MPI`` module.
        call_for: the communicator's ``call_for`` (what the ranks agree on, None with checks off).
        agreement: the communicator's agreement (whether it runs now is part of a plan's key).
    """

    def __init__(self, comm, MPI, call_for: Callable[..., CollectiveCall | None], agreement: Agreement) -> None:
        self._comm, self._MPI = comm, MPI
        self._size = comm.Get_size()
        self._call_for = call_for
        self._agreement = agreement
        self._plans: dict[tuple, _Plan | None] = {}

    def plan(
        self, tensors, op: ReduceOp, check: str | None, *, label: str = "", step: int | None = None
    ) -> Collective | None:
        """Return the allreduce of ``tensors`` (one tensor, or a list of one) planned before, or None when it is not small.

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
        # Everything the descriptor and the agreement's call depend on: a new label, step or
        # patience (the optimizer's buckets, a checkpoint's wait) or checks switched is a new plan.
        agreement = self._agreement
        key = (
            tensor.shape,
            tensor.dtype,
            op,
            check,
            label,
            step,
            oplog.is_patient(),
            agreement.check_collectives or agreement.timeout is not None,
        )
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._make(tensor, op, check, label, step, key)
        if plan is None:
            return None
        oplog.mark_collective_thread()
        target = tensor.detach() if tensor.requires_grad else tensor  # a parameter, reduced in place as data
        return Collective("allreduce", partial(self._reduce, plan, target, tensors), tensor, plan.call, plan.desc)

    def _make(
        self, tensor: torch.Tensor, op: ReduceOp, check: str | None, label: str, step: int | None, key: tuple
    ) -> _Plan | None:
        carried = DTYPES.get(tensor.dtype)
        small = carried is not None and carried.native and 0 < tensor.nbytes < SMALL_BYTES
        plan = None
        if small:
            check_reducible(tensor.dtype, op)
            plan = _Plan(
                oplog.describe("allreduce", tensor.shape, dtype_name(tensor.dtype), label=label, step=step),
                # A list of one, as the general path's plan_each describes it: the same fingerprint.
                self._call_for(check, "allreduce", [tensor], label=label, step=step, reduce_op=op),
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
