"""The one table of reduction ops: hpcddp's ``ReduceOp``, torch.distributed's and MPI's.

torch's ``ReduceOp.AVG`` is hpcddp's ``AVERAGE``; an average travels as a sum (gloo and
MPI have no average) and is divided by the number of ranks after (integers toward zero,
as NCCL divides them). The MPI ops for float16 and bfloat16, which MPI cannot reduce
itself, are made here once per process. bool tensors reduce as gloo reduces them (torch
2.13): SUM and MAX are a logical or, MIN and PRODUCT a logical and, with MPI's logical ops
(the only ones MPI defines on ``MPI_C_BOOL``); an average of bools is refused, as on gloo.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from .dtypes import DTYPES, host_array

__all__ = [
    "REDUCTIONS",
    "ReduceOp",
    "Reduction",
    "check_average",
    "check_reducible",
    "divide_average_",
    "from_torch",
    "mpi_op",
    "parse_op",
    "to_torch",
    "travels_as",
]


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' tensors (torch's ops map onto these: ``from_torch``)."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hash them so too, in C (Enum's own
    # __hash__ is a Python call, on the key of every planned small allreduce).
    __hash__ = object.__hash__

    @property
    def bitwise(self) -> bool:
        """True for the integer-only ops BAND, BOR and BXOR."""
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


class Reduction(NamedTuple):
    """One row of the table: what torch and MPI call a ReduceOp."""

    #: torch.distributed's name, ``dist.ReduceOp.<torch>``
    torch: str
    #: MPI's name, ``MPI.<mpi>``
    mpi: str
    #: how two 16-bit float buffers combine (None: integers only)
    combine: Callable | None
    #: MPI's logical op that reduces bool tensors (None: bools cannot be reduced so)
    logical: str | None


REDUCTIONS: dict[ReduceOp, Reduction] = {
    ReduceOp.SUM: Reduction("SUM", "SUM", torch.add, "LOR"),
    ReduceOp.AVERAGE: Reduction("AVG", "SUM", torch.add, None),
    ReduceOp.MIN: Reduction("MIN", "MIN", torch.minimum, "LAND"),
    ReduceOp.MAX: Reduction("MAX", "MAX", torch.maximum, "LOR"),
    ReduceOp.PRODUCT: Reduction("PRODUCT", "PROD", torch.mul, "LAND"),
    ReduceOp.BAND: Reduction("BAND", "BAND", None, "LAND"),
    ReduceOp.BOR: Reduction("BOR", "BOR", None, "LOR"),
    ReduceOp.BXOR: Reduction("BXOR", "BXOR", None, "LXOR"),
}
_BY_TORCH_NAME = {row.torch: op for op, row in REDUCTIONS.items()}
_ALIASES = {"avg": ReduceOp.AVERAGE, "mean": ReduceOp.AVERAGE, "prod": ReduceOp.PRODUCT}


def parse_op(op: str | ReduceOp, argument: str = "op") -> ReduceOp:
    """Turn ``"average"``/``"sum"``/``"min"``/``"max"``/``"product"``/``"band"``/``"bor"``/``"bxor"``
    (or a ReduceOp) into a ReduceOp.

    Args:
        op: the user's value.
        argument: the argument name to put in the error message.
    """
    if isinstance(op, ReduceOp):
        return op
    key = str(op).lower()
    try:
        return _ALIASES.get(key) or ReduceOp(key)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in ReduceOp)
        raise ValueError(f"{argument} must be one of {choices}, got {op!r}") from None


def travels_as(op: ReduceOp) -> ReduceOp:
    """Return the op that moves the data: a sum for an average (divided by the number of ranks after)."""
    return ReduceOp.SUM if op is ReduceOp.AVERAGE else op


def from_torch(op: Any) -> ReduceOp:
    """Return the ReduceOp for torch's ``op`` (a ``dist.ReduceOp`` or its ``RedOpType``).

    Raises ValueError for PREMUL_SUM, which is NCCL's alone.
    """
    for theirs, ours in _torch_ops():
        if op == theirs:
            return ours
    name = getattr(getattr(op, "op", op), "name", None)
    if name == "PREMUL_SUM":
        raise ValueError("ReduceOp.PREMUL_SUM is NCCL-only: scale the tensor, then reduce with ReduceOp.SUM")
    if name not in _BY_TORCH_NAME:
        raise ValueError(f"op must be a torch.distributed.ReduceOp, got {op!r}")
    return _BY_TORCH_NAME[name]


@functools.cache
def _torch_ops() -> tuple:
    """torch's ops beside ours, SUM first: comparing costs a third of reading an op's name, on every collective."""
    import torch.distributed as dist

    pairs = [(getattr(dist.ReduceOp, name), op) for name, op in _BY_TORCH_NAME.items()]
    return tuple(sorted(pairs, key=lambda pair: pair[1] is not ReduceOp.SUM))


def to_torch(op: ReduceOp):
    """Return the ``dist.ReduceOp`` that moves ``op``'s data over torch.distributed (an average: SUM)."""
    import torch.distributed as dist

    return getattr(dist.ReduceOp, REDUCTIONS[travels_as(op)].torch)


def check_average(dtype: torch.dtype, op: ReduceOp) -> None:
    """Raise TypeError for an average of integers in hpcddp's own API (the sum divided after would truncate).

    The torch backend takes one (``ReduceOp.AVG``) and truncates, as NCCL does: ``divide_average_``.
    """
    if op is ReduceOp.AVERAGE and not dtype.is_floating_point:
        raise TypeError(f"op='average' needs a floating-point tensor, got {dtype}: use op='sum'")


def check_reducible(dtype: torch.dtype, op: ReduceOp, what: str = "allreduce") -> None:
    """Raise TypeError for a dtype or op MPI cannot reduce.

    An average of integers passes: ``divide_average_`` truncates it. hpcddp's own API
    refuses one before it gets here (``check_average``); torch's ``ReduceOp.AVG`` on the
    ``"mpi"`` backend gets NCCL's result.

    Args:
        dtype: the tensor's.
        op: the reduction.
        what: the collective, for the message.
    """
    if dtype not in DTYPES:
        raise TypeError(f"{what} does not support tensors of dtype {dtype}")
    if dtype is torch.bool and REDUCTIONS[op].logical is None:
        raise TypeError(
            f"op={REDUCTIONS[op].torch} cannot reduce bool tensors (gloo refuses them too): use ReduceOp.SUM or MAX "
            "(logical or) or MIN or PRODUCT (logical and), or convert the tensor to a number type first"
        )
    if op.bitwise and dtype.is_floating_point:
        raise TypeError(f"op='{op.value}' needs an integer tensor, got {dtype}")


_ONE_THREAD_DIVIDES = (torch.float32, torch.float64)


def divide_average_(summed: torch.Tensor, op: ReduceOp, size: int) -> torch.Tensor:
    """Turn the sum an average travelled as into the average, in place; other ops leave ``summed`` as it is.

    Integers are divided toward zero, as NCCL's ``ncclAvg`` does (and Horovod's integer
    average): PyTorch Lightning logs with ``sync_dist=True`` send ``ReduceOp.AVG`` of an
    int64 batch size to every backend but gloo.

    Args:
        summed: the reduced sum.
        op: the reduction the caller asked for.
        size: the number of ranks that contributed.
    """
    if op is not ReduceOp.AVERAGE:
        return summed
    if summed.dtype in _ONE_THREAD_DIVIDES and summed.device.type == "cpu" and summed.is_contiguous():
        # On one thread: where ranks are not bound to cores (mpirun --bind-to none, hpcddp run
        # --no-bind) torch's div_ runs on several intra-op threads, which fight the ranks for
        # the cores (4 MiB: 28 ms on 2 threads against 0.3 ms on one, other work on the
        # machine). The same IEEE division.
        view = host_array(summed.reshape(-1))
        np.divide(view, size, out=view)
        return summed
    if summed.is_floating_point() or summed.is_complex():
        return summed.div_(size)
    return summed.div_(size, rounding_mode="trunc")


_half_ops: dict[tuple[torch.dtype, ReduceOp], Any] = {}
_half_ops_lock = threading.Lock()


def mpi_op(MPI, dtype: torch.dtype, op: ReduceOp):
    """Return the MPI op that reduces ``dtype`` with ``op`` (an average: the sum)."""
    if dtype is torch.bool:
        return getattr(MPI, REDUCTIONS[op].logical)
    op = travels_as(op)
    if DTYPES[dtype].native:
        return getattr(MPI, REDUCTIONS[op].mpi)
    key = (dtype, op)
    made = _half_ops.get(key)
    if made is None:
        with _half_ops_lock:
            made = _half_ops.get(key)
            if made is None:
                made = _half_ops[key] = MPI.Op.Create(_half_reducer(dtype, REDUCTIONS[op].combine), commute=True)
    return made


def _half_reducer(dtype: torch.dtype, combine: Callable):
    def reduce_half(inbuf, outbuf, datatype) -> None:
        out = torch.frombuffer(outbuf, dtype=dtype)
        combine(out, torch.frombuffer(inbuf, dtype=dtype), out=out)

    return reduce_half
