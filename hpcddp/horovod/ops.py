"""Horovod's allreduce family (plain, in place, grouped, sparse; differentiable as Horovod's) and its handles."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Handle, ReduceOp, parse_op
from .adasum import adasum_async, check_adasum
from .basics import Adasum, Average, Sum, at_init
from .compression import Compression
from .process_sets import communicator_of, global_process_set

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "poll", "synchronize",
]  # fmt: skip

# The operations in flight by (operation, process set, name), as Horovod's tensor table holds
# "<op>.<name>" per process set: a second one under a name is refused until the first is synchronized.
_in_flight: dict[tuple, Handle] = {}
# The table is swept of synchronized operations whenever it doubles: a script that names its
# operations per step (name=f"loss{step}") would otherwise keep every handle, and its result, for good.
_SWEEP_AT_LEAST = 64
_sweep_at = _SWEEP_AT_LEAST
_table_lock = threading.Lock()  # threads may start named operations at once
_STARTING = Handle("a named operation being started")  # never waited: its name is taken


def _forget_all() -> None:
    """A new communicator (after shutdown): nothing of the old one is in flight."""
    global _sweep_at
    with _table_lock:
        _in_flight.clear()
        _sweep_at = _SWEEP_AT_LEAST


at_init(_forget_all)


def claim(name: str | None, kind: str, process_set) -> tuple | None:
    """Return the key ``name`` is kept under; raise ValueError, as Horovod does, while it is taken.

    A name is taken until its operation was synchronized (waited for), not until it completed:
    completion races with the next call (a peer already waiting completes it at once), so one
    rank would refuse a second operation and another start it, the ranks out of step.

    Args:
        name: Horovod's ``name=`` argument, or None (never taken).
        kind: the operation ("allreduce", "allgather", ...).
        process_set: the process set it runs on.
    """
    if name is None:
        return None
    key = (kind, process_set, name)
    previous = _in_flight.get(key)
    if previous is not None and not previous.waited:
        raise ValueError(f"{kind} {name!r} is still in flight: synchronize it first or give this one another name")
    return key


def start(name: str | None, kind: str, process_set, launch: Callable[[str], Handle]) -> Handle:
    """Run ``launch(label)`` (which starts a collective and returns its handle) under ``name``.

    Args:
        name: Horovod's ``name=`` argument, or None.
        kind: the operation ("allreduce", "allgather", ...): names are per operation and process set.
        process_set: the process set it runs on.
        launch: starts the collective with ``label`` (``name`` or "") as its ``check`` and
            ``label``: the ranks agree under that name, and stall reports name it.
    """
    key = None
    try:
        with _table_lock:  # taken at once, so that a thread starting the same name meanwhile is refused
            key = claim(name, kind, process_set)
            if key is not None:
                _in_flight[key] = _STARTING
        handle = launch(name or "")
        if key is not None:
            _remember(key, handle)
    except BaseException:  # also Ctrl-C: a placeholder left behind would hold the name for good
        if key is not None:
            with _table_lock:
                if _in_flight.get(key) is _STARTING:
                    del _in_flight[key]
        raise
    return handle


def _remember(key: tuple, handle: Handle) -> None:
    """Keep ``handle`` under ``key``; forget synchronized ones when the table has doubled (amortized O(1))."""
    global _sweep_at
    with _table_lock:
        _in_flight[key] = handle
        if len(_in_flight) >= _sweep_at:
            for done in [k for k, h in _in_flight.items() if h.waited]:
                del _in_flight[done]
            _sweep_at = max(_SWEEP_AT_LEAST, 2 * len(_in_flight))


def start_group(name: str | None, kind: str, process_set, members: list[Callable[[str | None], Handle]]) -> Handle:
    """Start ``members[i](name.i)``, one operation ``kind`` each, as the group ``name``; it yields their outputs.

    Each member takes its name as its one argument (a ``functools.partial`` of the operation).

    Every name is checked before anything starts, so a refused group changes no tensor and sends
    nothing. If a member fails to start (on gloo a mismatch raises there), the members already
    started are waited for: their names are free again and every rank stays in step.
    """
    names = [None if name is None else f"{name}.{i}" for i in range(len(members))]
    claim(name, f"grouped_{kind}", process_set)
    for member in names:
        claim(member, kind, process_set)
    handles = start_each([functools.partial(member, name_of_member) for member, name_of_member in zip(members, names)])
    return start(name, f"grouped_{kind}", process_set, lambda _label: GroupHandle(handles, f"grouped_{kind}"))


def start_each(starts: list[Callable[[], Handle]]) -> list[Handle]:
    """Call each of ``starts`` and return their handles; if one fails, wait for those already started, then raise.

    Waiting frees their names and keeps every rank in step (on gloo a mismatch raises at the start).
    """
    handles: list[Handle] = []
    try:
        for begin in starts:
            handles.append(begin())
    except Exception:
        with contextlib.suppress(Exception):
            wait_all(handles)
        raise
    return handles


def wait_all(handles: list[Handle], timeout: float | None = None) -> list:
    """Wait for every handle, also after one raised (each is then synchronized, its name free); raise the first error."""
    results, error = [], None
    for handle in handles:
        try:
            results.append(handle.wait(timeout))
        except TimeoutError:
            raise
        except Exception as err:  # noqa: BLE001 - raised below, once the others were waited for
            error = error or err
            results.append(None)
    if error is not None:
        raise error
    return results


def resolve_op(op, average=None) -> ReduceOp | str:
    """Return the ReduceOp (or ``Adasum``) for Horovod's ``op`` and deprecated ``average`` arguments."""
    if average is not None:
        if op is not None:
            raise ValueError(f"give op= or the deprecated average=, not both: got op={op!r}, average={average!r}")
        return Average if average else Sum
    if op is Adasum:
        return Adasum
    return Average if op is None else parse_op(op)


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``factor`` as Horovod does: integers in float64 then truncated,
    16-bit floats in float32, other floats in their own precision."""
    if factor == 1.0:
        return tensor
    if not tensor.dtype.is_floating_point:
        return tensor.copy_((tensor.double() * factor).to(tensor.dtype))
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.copy_(tensor.float() * torch.tensor(factor, dtype=torch.float32))
    return tensor.mul_(torch.tensor(factor, dtype=tensor.dtype, device=tensor.device))


def allreduce_handle(tensor, op: ReduceOp | str, name, prescale_factor, postscale_factor, in_place, process_set,
                     compression=Compression.none) -> Handle:  # fmt: skip
    """Start one allreduce as Horovod's: scaling, integer averages, compression; the handle yields the output."""
    if op is Adasum:  # Horovod refuses these before it looks at the process set
        check_adasum(
            communicator_of(global_process_set).size, tensor.dtype, global_set=process_set is global_process_set
        )
    comm = communicator_of(process_set)
    claim(name, "allreduce", process_set)  # before the prescale below writes an in-place tensor
    # detach(): in place on a parameter (a leaf that requires grad) writes its data, as Horovod does.
    source = tensor.detach() if in_place else tensor.detach().clone()
    scale_(source, prescale_factor)
    # Horovod's integer average truncates a sum; MPI sums, we divide after.
    integer_average = op is Average and not source.dtype.is_floating_point
    wire, ctx = compression.compress(source)
    if op is Adasum:
        handle = start(name, "allreduce", process_set, lambda label: adasum_async(comm, wire, check=label, label=label))
    else:
        reduce_op = Sum if integer_average else op
        handle = start(
            name,
            "allreduce",
            process_set,
            lambda label: comm.allreduce_async_(wire, reduce_op, check=label, label=label),
        )

    def finish(out: torch.Tensor) -> torch.Tensor:
        out = compression.decompress(out, ctx)
        if integer_average:
            out.div_(comm.size, rounding_mode="trunc")
        scale_(out, postscale_factor)
        if out is not source:
            source.copy_(out)
        return tensor if in_place else source

    return handle.then(finish)


class _Allreduce(torch.autograd.Function):
    """Allreduce whose gradient is the same allreduce of the incoming gradient (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return allreduce_handle(tensor, op, name, prescale_factor, postscale_factor, False, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        reduced = allreduce_handle(grad, op, None, prescale, postscale, False, process_set).wait()
        return reduced, None, None, None, None, None


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing a copy of ``tensor`` (Average by default); ``synchronize`` returns it."""
    return allreduce_handle(
        tensor, resolve_op(op, average), name, prescale_factor, postscale_factor, False, process_set
    )


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Return the reduction of ``tensor`` across ranks (Average by default), leaving it unchanged.

    Differentiable: the gradient is the same allreduce of the incoming gradient.
    """
    reduce_op = resolve_op(op, average)
    if tensor.requires_grad and torch.is_grad_enabled():
        wire, ctx = compression.compress(tensor)
        reduced = _Allreduce.apply(wire, reduce_op, name, prescale_factor, postscale_factor, process_set)
        return compression.decompress(reduced, ctx)
    return allreduce_handle(
        tensor, reduce_op, name, prescale_factor, postscale_factor, False, process_set, compression
    ).wait()


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing ``tensor`` in place; ``synchronize`` returns it."""
    return allreduce_handle(tensor, resolve_op(op, average), name, prescale_factor, postscale_factor, True, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:  # fmt: skip
    """Reduce ``tensor`` in place across ranks and return it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def _grouped(tensors, op, name, prescale, postscale, in_place, process_set) -> Handle:
    """Start one allreduce per tensor; the handle yields the list of outputs."""
    members = [
        functools.partial(
            allreduce_handle,
            t,
            op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            in_place=in_place,
            process_set=process_set,
        )
        for t in tensors
    ]
    return start_group(name, "allreduce", process_set, members)


class GroupHandle(Handle):
    """One handle over several: done when all are, its result the list of theirs."""

    def __init__(self, handles: list[Handle], name: str) -> None:
        super().__init__(name)
        self._handles = handles

    def poll(self) -> bool:
        return all(h.poll() for h in self._handles)

    def _block(self, timeout: float | None) -> bool:
        if not self._done.is_set():
            try:
                self.set_result(wait_all(self._handles, timeout))
            except TimeoutError:
                return False
            except BaseException as err:  # noqa: BLE001 - raised by wait(), in the caller's thread
                self.set_exception(err)
        return True


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_grouped(tensors, op, name, prescale, postscale, False, process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (
            None,
            None,
            None,
            None,
            None,
            *_grouped(grads, op, None, prescale, postscale, False, process_set).wait(),
        )


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing copies of ``tensors``; ``synchronize`` returns the list of reductions."""
    return _grouped(tensors, resolve_op(op, average), name, prescale_factor, postscale_factor, False, process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:  # fmt: skip
    """Return the reduction of each tensor in ``tensors``; differentiable."""
    reduce_op = resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    wires = [wire for wire, _ in pairs]
    if any(t.requires_grad for t in wires) and torch.is_grad_enabled():
        reduced = _GroupedAllreduce.apply(reduce_op, name, prescale_factor, postscale_factor, process_set, *wires)
    else:
        reduced = _grouped(wires, reduce_op, name, prescale_factor, postscale_factor, False, process_set).wait()
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> Handle:  # fmt: skip
    """Start reducing every tensor of ``tensors`` in place."""
    return _grouped(tensors, resolve_op(op, average), name, prescale_factor, postscale_factor, True, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:  # fmt: skip
    """Reduce every tensor of ``tensors`` in place and return them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def synchronize(handle: Handle) -> Any:
    """Wait for an ``*_async`` operation and return its output."""
    if callable(handle) and not isinstance(handle, Handle):
        return handle()
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize takes a handle from an *_async function, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """Return True if the ``*_async`` operation behind ``handle`` has finished."""
    return handle.poll()
